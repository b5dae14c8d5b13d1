"""The shared expert's GPU backends (``swiglu_mlp`` through ``linear``; with the Triton SwiGLU) vs the reference:
on the CPU the same function over the reference GEMMs (bf16 and fp16, clamps engaged; fp32 weights fall back to
the reference bitwise), on CUDA at V4-Flash (d 4096, I 2048) and V4.1-Flash (d 5120, I 2304) shapes for decode
and prefill row counts, the registry's choice (the Triton SwiGLU, bitwise equal to the torch chain), and bitwise
row invariance in batch-invariant mode."""

import pytest
import torch
from deepinfer_kernels.ops.moe import swiglu_mlp
from deepinfer_kernels.ops.moe.reference import swiglu_mlp_ref
from deepinfer_kernels.ops.moe.swiglu_linear import swiglu_mlp_linear
from deepinfer_kernels.registry import resolve, set_batch_invariant
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close

LIMIT = 10.0
TOL = 8e-3  # the hidden state is rounded to 16 bits before the down projection


def _inputs(t: int, d: int, i: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * 2
    w1, w3 = (torch.randn(i, d, generator=g) / d**0.5 * 3 for _ in range(2))
    w2 = torch.randn(d, i, generator=g) / i**0.5
    return [a.to(device=device, dtype=dtype) for a in (x, w1, w3, w2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_matches_reference(dtype):
    x, w1, w3, w2 = _inputs(9, 256, 128, dtype, "cpu", 0)
    gate = x.float() @ w1.float().t()
    assert (gate > LIMIT).any()  # the clamp is engaged
    out = swiglu_mlp_linear(x, w1, w3, w2, swiglu_limit=LIMIT)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rel_close(out, swiglu_mlp_ref(x, w1, w3, w2, swiglu_limit=LIMIT), TOL, str(dtype))


def test_cpu_fp32_falls_back_to_the_reference():
    x, w1, w3, w2 = _inputs(5, 64, 32, torch.float32, "cpu", 1)
    ref = swiglu_mlp_ref(x, w1, w3, w2, swiglu_limit=LIMIT)
    assert_bitwise(swiglu_mlp_linear(x, w1, w3, w2, swiglu_limit=LIMIT), ref, "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("d, i", [(4096, 2048), (5120, 2304)], ids=["v4", "v41"])
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_cuda_matches_reference(d, i, t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels.ops.moe.swiglu_triton import swiglu_mlp_triton

    assert resolve("swiglu_mlp", "cuda") is swiglu_mlp_triton
    x, w1, w3, w2 = _inputs(t, d, i, torch.bfloat16, "cuda", t + i)
    # the Triton SwiGLU is the reference's formula with the same roundings: the same bits as the torch chain
    assert_bitwise(
        swiglu_mlp(x, w1, w3, w2, swiglu_limit=LIMIT), swiglu_mlp_linear(x, w1, w3, w2, swiglu_limit=LIMIT), "vs linear"
    )
    assert_rel_close(
        swiglu_mlp(x, w1, w3, w2, swiglu_limit=LIMIT),
        swiglu_mlp_ref(x, w1, w3, w2, swiglu_limit=LIMIT),
        TOL,
        f"{t}x{d}x{i}",
    )


@pytest.mark.gpu
def test_cuda_rows_invariant_in_batch_invariant_mode():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels.ops.moe.swiglu_triton import swiglu_mlp_triton

    x, w1, w3, w2 = _inputs(512, 4096, 2048, torch.bfloat16, "cuda", 7)
    set_batch_invariant(True)
    try:
        assert resolve("swiglu_mlp", "cuda") is swiglu_mlp_triton
        full = swiglu_mlp(x, w1, w3, w2, swiglu_limit=LIMIT)
        for r in (0, 300):
            assert_bitwise(swiglu_mlp(x[r : r + 1], w1, w3, w2, swiglu_limit=LIMIT)[0], full[r], f"row {r}")
            assert_bitwise(swiglu_mlp(x[r : r + 8], w1, w3, w2, swiglu_limit=LIMIT)[0], full[r], f"row {r} in 8")
    finally:
        set_batch_invariant(None)

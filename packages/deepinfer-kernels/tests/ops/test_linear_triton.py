"""GPU backends of ``linear`` vs the reference: the batch-invariant Triton kernel under Triton's interpreter on
CPU at small shapes (ragged K, K splits, fp32 IEEE and bf16), and both backends on CUDA at V4.1-Flash shapes
with fresh random inputs, plus bitwise row invariance of ``triton_fixed`` (one row alone, inside 64, inside
4096). ``out_dtype=torch.float32`` (bf16 x bf16 written in fp32: the LM head, routers, compressors) likewise."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.linear.cublas import linear_cublas  # noqa: E402
from deepinfer_kernels.ops.linear.reference import linear_ref  # noqa: E402
from deepinfer_kernels.ops.linear.triton import linear_triton_fixed  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _interp_matches_reference(dtype: str, m: int, n: int, k: int) -> None:
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dt)
    y = linear_triton_fixed(x, w)
    assert y.dtype == dt and y.shape == (m, n)
    assert_rel_close(y, linear_ref(x, w), TOL[dt], f"{dtype} {m}x{n}x{k}")
    for r in {0, m // 2, m - 1}:
        assert_bitwise(linear_triton_fixed(x[r : r + 1].clone(), w)[0], y[r], f"row {r} alone vs in {m}")


def _interp_3d_bf16_weight_and_empty() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 96, generator=g)
    w = torch.randn(40, 96, generator=g).to(torch.bfloat16)  # cast to x's dtype, as the reference does
    assert_rel_close(linear_triton_fixed(x, w), linear_ref(x, w), 1e-5, "3-D x, bf16 weight")
    assert linear_triton_fixed(x[:0], w).shape == (0, 3, 40)


def _interp_fp32_out(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    y = linear_triton_fixed(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert_rel_close(y, linear_ref(x.float(), w.float()), 1e-5, f"bf16 -> fp32 {m}x{n}x{k}")
    assert_bitwise(linear_triton_fixed(x[m - 1 :].clone(), w, out_dtype=torch.float32)[0], y[m - 1], "row alone")


INTERP_CASES = {
    f"{dt}-{m}x{n}x{k}": ("_interp_matches_reference", (dt, m, n, k))
    for dt in ("float32", "bfloat16")
    for m, n, k in ((1, 64, 1024), (5, 70, 100), (70, 130, 520))  # K split of 2; ragged N, K and M tiles
}
INTERP_CASES["3d-bf16-weight-empty"] = ("_interp_3d_bf16_weight_and_empty", ())
INTERP_CASES["fp32-out-5x70x100"] = ("_interp_fp32_out", (5, 70, 100))
INTERP_CASES["fp32-out-70x130x520"] = ("_interp_fp32_out", (70, 130, 520))


def test_fp32_out_is_the_upcast_product():
    """The public op: out_dtype=fp32 is linear(x.float(), w.float()) (the reference bitwise; a mixed-precision pair
    is upcast), and an fp32 x ignores it."""
    from deepinfer_kernels import linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 40, generator=g).to(torch.bfloat16)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    want = linear(x.float(), w.float())
    assert_bitwise(linear(x, w, out_dtype=torch.float32), want, "bf16 x bf16 -> fp32")
    assert_bitwise(linear(x, w.float(), out_dtype=torch.float32), want, "bf16 x fp32 -> fp32")
    assert_bitwise(linear(x.float(), w, out_dtype=torch.float32), want, "fp32 x bf16 -> fp32")
    with pytest.raises(ValueError, match="out_dtype"):
        linear(x, w, out_dtype=torch.float16)


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process

# V4.1-Flash projections (in, out, activation dtype): wq_a, wq_b, wkv, wo_b, shared w1|w3, router and LM head (fp32)
SHAPES = [
    (5120, 1280, torch.bfloat16),
    (1280, 32768, torch.bfloat16),
    (5120, 512, torch.bfloat16),
    (8192, 5120, torch.bfloat16),
    (5120, 4608, torch.bfloat16),
    (5120, 384, torch.float32),
    (5120, 129280, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("k, n, dtype", SHAPES)
def test_gpu_matches_reference_and_row_invariant(k, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(64, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    ref = linear_ref(x, w)
    y = linear_triton_fixed(x, w)
    assert_rel_close(y, ref, TOL[dtype], f"triton_fixed {k}->{n} {dtype}")
    assert_rel_close(linear_cublas(x, w), ref, TOL[dtype], f"cublas {k}->{n} {dtype}")
    for r in (0, 17, 63):
        assert_bitwise(linear_triton_fixed(x[r : r + 1].clone(), w)[0], y[r], f"row {r} alone vs in 64")
    if n <= 32768:
        big = torch.randn(4096, k, generator=g, device="cuda").to(dtype)
        big[4000] = x[17]
        assert_bitwise(linear_triton_fixed(big, w)[4000], y[17], "row inside a batch of 4096")


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", [(4096, 129280), (5120, 129280), (4096, 256), (4096, 1024)])  # heads, router, CSA
def test_gpu_fp32_out(k, n):
    g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
    x = torch.randn(64, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    ref = linear_ref(x.float(), w.float())
    for name, fn in (("triton_fixed", linear_triton_fixed), ("cublas", linear_cublas)):
        y = fn(x, w, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        assert_rel_close(y, ref, 1e-5, f"{name} bf16 {k}->{n} -> fp32")
    y = linear_triton_fixed(x, w, out_dtype=torch.float32)
    for r in (0, 63):
        assert_bitwise(linear_triton_fixed(x[r : r + 1].clone(), w, out_dtype=torch.float32)[0], y[r], f"row {r}")

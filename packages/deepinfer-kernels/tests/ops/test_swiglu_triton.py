"""swiglu_clamp: the Triton SwiGLU vs the reference under Triton's interpreter on CPU (fp32 and bf16 inputs, fp32 and
bf16 outputs, the clamp engaged on both sides, no clamp, NaN and infinities, a length that is not a multiple of the
block, strided inputs, the two column halves of one GEMM output read in place) and on CUDA at the shared expert's
prefill shapes (V4 [8192, 2048], V4.1 [8192, 2304]), where it must equal the reference bit for bit (libdevice exp,
IEEE division, no FMA contraction)."""

import pytest
import torch
from deepinfer_kernels.ops.moe.reference import swiglu_clamp_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

LIMIT = 10.0


def _gate_up(shape, seed: int, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(shape, generator=g) * 8 for _ in range(2))  # |x| > 10 in ~20% of entries
    return gate.to(device=device, dtype=dtype), up.to(device=device, dtype=dtype)


def _interp_matches_reference(dtype: str, out: str, limit):
    from deepinfer_kernels.ops.moe.swiglu_triton import swiglu_clamp_triton

    dt, odt = getattr(torch, dtype), getattr(torch, out)
    gate, up = _gate_up((37, 130), seed=len(dtype) + len(out), dtype=dt)
    if limit is not None:
        assert (gate > limit).any() and (up < -limit).any() and (up > limit).any()
    got = swiglu_clamp_triton(gate, up, limit, out_dtype=odt)
    want = swiglu_clamp_ref(gate, up, limit)
    assert got.dtype == odt and got.shape == gate.shape
    if odt == torch.float32:
        assert_rel_close(got, want, 1e-6, f"{dtype} -> {out} limit={limit}")  # numpy's exp: within an ulp
    else:
        assert_rel_close(got, want.to(odt), 1e-2, f"{dtype} -> {out} limit={limit}")


def _interp_specials_and_layouts():
    from deepinfer_kernels.ops.moe.swiglu_triton import swiglu_clamp_triton

    gate = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf"), 0.0, 50.0, -50.0, 3.0])
    up = torch.tensor([1.0, float("nan"), 2.0, 2.0, 5.0, 50.0, 1.0, -float("inf")])
    got, want = swiglu_clamp_triton(gate, up, LIMIT), swiglu_clamp_ref(gate, up, LIMIT)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    ok = ~torch.isnan(want)
    assert_rel_close(got[ok], want[ok], 1e-6, "specials")
    g, u = _gate_up((9, 64), seed=5)
    assert_rel_close(swiglu_clamp_triton(g[:, ::2], u[:, 1::2], LIMIT), swiglu_clamp_ref(g[:, ::2], u[:, 1::2], LIMIT),
                     1e-6, "strided")  # fmt: skip
    assert swiglu_clamp_triton(g[:0], u[:0], LIMIT).shape == (0, 64)
    gu = torch.cat(_gate_up((7, 48), seed=6), dim=1).bfloat16()  # [T, 2 I]: a fused gate/up GEMM's output
    gate, up = gu.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    got = swiglu_clamp_triton(gate, up, LIMIT, out_dtype=torch.bfloat16)  # read in place (row strides)
    assert_bitwise(got, swiglu_clamp_triton(gate.contiguous(), up.contiguous(), LIMIT, torch.bfloat16), "halves")


INTERP_CASES = {
    f"{dt}-to-{o}-limit{lim}": ("_interp_matches_reference", (dt, o, lim))
    for dt in ("float32", "bfloat16")
    for o in ("float32", "bfloat16")
    for lim in (LIMIT, None)
}
INTERP_CASES["specials-and-layouts"] = ("_interp_specials_and_layouts", ())

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


def test_registered_for_cuda_only():
    from deepinfer_kernels.registry import list_ops, resolve

    assert "triton" in list_ops()["swiglu_clamp"]
    assert resolve("swiglu_clamp", "cpu") is swiglu_clamp_ref


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [2048, 2304], ids=["v4", "v41"])
def test_gpu_bitwise_vs_reference(inter):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels.ops.moe import swiglu_clamp
    from deepinfer_kernels.ops.moe.swiglu_triton import swiglu_clamp_triton

    gate, up = _gate_up((8192, inter), seed=inter, device="cuda")
    want = swiglu_clamp_ref(gate, up, LIMIT)
    assert_bitwise(swiglu_clamp(gate, up, LIMIT), want, "op (fp32 out)")
    assert_bitwise(swiglu_clamp_triton(gate, up, LIMIT, out_dtype=torch.bfloat16), want.to(torch.bfloat16), "bf16 out")
    assert_bitwise(swiglu_clamp_triton(gate, up, None), swiglu_clamp_ref(gate, up, None), "no clamp")
    one = swiglu_clamp_triton(gate[100:101], up[100:101], LIMIT)
    assert_bitwise(one[0], want[100], "a row alone")
    # the halves of one [T, 2 I] bf16 GEMM output, read in place, rounded to bf16 (the FP8 shared expert's call)
    gu = torch.cat([gate, up], dim=1).bfloat16()
    for rows in (1, 8192):
        g16, u16 = gu[:rows].chunk(2, dim=-1)
        want16 = swiglu_clamp_ref(g16, u16, LIMIT, torch.bfloat16)
        assert_bitwise(swiglu_clamp(g16, u16, LIMIT, torch.bfloat16), want16, f"halves of [{rows}, 2 I], bf16 out")

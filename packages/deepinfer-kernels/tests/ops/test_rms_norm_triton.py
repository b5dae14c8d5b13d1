"""Triton rms_norm vs the reference: the kernel under Triton's interpreter on CPU at small shapes (in one
child process, so it runs whatever else imported triton first), and on CUDA at V4.1-Flash shapes (fresh
random inputs) plus bitwise row invariance."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref  # noqa: E402
from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def _interp_matches_reference(dtype: str, d: int, weighted: bool) -> None:
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(2, 3, d, generator=g) * 3).to(dt)
    w = torch.randn(d, generator=g) if weighted else None
    assert_rel_close(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TOL[dt], f"{dtype} d={d}")


def _interp_zero_row_tiny_eps_and_invariance() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 128, generator=g)
    x[4] = 0
    y = rms_norm_triton(x, None, 1e-20)
    assert torch.equal(y[4], torch.zeros(128)), "an all-zero row must stay 0 with V4.1's eps"
    assert_rel_close(y, rms_norm_ref(x, None, 1e-20), 2e-6, "eps 1e-20")
    for r in (0, 4, 8):
        assert_bitwise(rms_norm_triton(x[r : r + 1], None, 1e-20)[0], y[r], f"row {r}")


INTERP_CASES = {
    f"{dt}-d{d}-{'w' if w else 'now'}": ("_interp_matches_reference", (dt, d, w))
    for dt in ("float32", "bfloat16")
    for d in (64, 300, 9000)  # 9000 > MAX_BLOCK: the chunked loop
    for w in (True, False)
}
INTERP_CASES["zero-row-eps-invariance"] = ("_interp_zero_row_tiny_eps_and_invariance", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [512, 1024, 4096, 7168])  # kv / q latents, hidden sizes
@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_gpu_matches_reference_and_row_invariant(dtype, d, eps):
    g = torch.Generator(device="cuda").manual_seed(d)
    x = torch.randn(64, d, generator=g, device="cuda").mul(4).to(dtype)
    w = torch.randn(d, generator=g, device="cuda")
    y = rms_norm_triton(x, w, eps)
    assert_rel_close(y, rms_norm_ref(x, w, eps), TOL[dtype], f"{dtype} d={d}")
    for r in (0, 17, 63):
        assert_bitwise(rms_norm_triton(x[r : r + 1].clone(), w, eps)[0], y[r], f"row {r} alone vs in 64")
    big = torch.randn(4096, d, generator=g, device="cuda").to(dtype)
    big[5] = x[17]
    assert_bitwise(rms_norm_triton(big, w, eps)[5], y[17], "row inside a batch of 4096")


@pytest.mark.gpu
def test_gpu_unweighted_3d_and_empty():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 7, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    assert_rel_close(rms_norm_triton(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), 1e-2, "3-D unweighted")
    assert rms_norm_triton(x[:0], None, 1e-6).shape == (0, 7, 512)

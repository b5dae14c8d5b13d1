"""Triton indexer_scores vs the reference: the kernel under Triton's interpreter on CPU at small
shapes, and on CUDA at V4.1-Flash shapes (32 indexer heads x 128) plus bitwise invariance in the
number of queries and of keys."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.indexer.reference import indexer_scores_ref  # noqa: E402
from deepinfer_kernels.ops.indexer.triton import indexer_scores_triton  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

SCALE = 128**-0.5


def _inputs(b, s, h, dh, n, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, s, h, dh, generator=g, device=device).to(dtype)
    k = torch.randn(b, n, dh, generator=g, device=device).to(dtype)
    w = torch.randn(b, s, h, generator=g, device=device) * h**-0.5
    return q, k, w


def _interp_matches_reference(dtype: str, h: int, dh: int) -> None:
    q, k, w = _inputs(2, 5, h, dh, 70, getattr(torch, dtype), "cpu", seed=h)
    assert_rel_close(indexer_scores_triton(q, k, w, SCALE), indexer_scores_ref(q, k, w, SCALE), 1e-5, dtype)


def _interp_invariance_in_queries_and_keys() -> None:
    q, k, w = _inputs(1, 7, 16, 32, 150, torch.float32, "cpu", seed=3)
    full = indexer_scores_triton(q, k, w, SCALE)
    assert_bitwise(indexer_scores_triton(q[:, 5:6], k, w[:, 5:6], SCALE)[0, 0], full[0, 5], "query alone")
    assert_bitwise(indexer_scores_triton(q, k[:, :77], w, SCALE), full[..., :77], "fewer keys")


INTERP_CASES = {
    f"{dt}-h{h}-dh{dh}": ("_interp_matches_reference", (dt, h, dh))
    for dt in ("float32", "bfloat16")
    for h, dh in ((8, 32), (64, 16), (6, 32))  # 6 heads: the reference fallback
}
INTERP_CASES["invariance"] = ("_interp_invariance_in_queries_and_keys", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("s", "n"), [(1, 32768), (64, 32768), (2048, 8192)])
def test_gpu_matches_reference_and_is_invariant(dtype, s, n):
    q, k, w = _inputs(1, s, 32, 128, n, dtype, "cuda", seed=s)
    out = indexer_scores_triton(q, k, w, SCALE)
    rows = torch.arange(0, s, max(1, s // 8), device="cuda")  # the reference is row-invariant: a subset
    assert_rel_close(out[:, rows], indexer_scores_ref(q[:, rows], k, w[:, rows], SCALE), 1e-5, f"{dtype}")
    r = int(rows[-1])
    assert_bitwise(indexer_scores_triton(q[:, r : r + 1].clone(), k, w[:, r : r + 1].clone(), SCALE)[0, 0],
                   out[0, r], "query alone vs in the batch")  # fmt: skip
    assert_bitwise(indexer_scores_triton(q, k[:, : n - 100], w, SCALE), out[..., : n - 100], "fewer keys")

"""Triton indexer_scores vs the reference: the kernel under Triton's interpreter on CPU at small
shapes, and on CUDA at V4.1-Flash shapes (32 indexer heads x 128) plus bitwise invariance in the
number of queries and of keys; indexer_scores_paged (keys read through block tables) bitwise equal to the dense
kernel over the gathered keys. indexer_topk (radix select) vs the reference: the same index sets on
random scores (no ties), with visible lengths and a candidate mask. candidate_block_mask: the reference's mask
exactly on continuous scores (NaN and -inf entries, rows with nothing visible, a budget above, at and below the block
count), and with tied block scores the same number of kept blocks of the same scores."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.indexer.candidate_triton import candidate_block_mask_triton  # noqa: E402
from deepinfer_kernels.ops.indexer.reference import (  # noqa: E402
    candidate_block_mask_ref,
    indexer_scores_paged_ref,
    indexer_scores_ref,
    indexer_topk_ref,
)
from deepinfer_kernels.ops.indexer.triton import (  # noqa: E402
    indexer_scores_paged_triton,
    indexer_scores_triton,
    indexer_topk_triton,
)
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


def _check_visible(b, s, h, n, dtype, device, seed, causal_ratio=None):
    """With ``visible``: the computed scores are the unmasked kernel's bits, the others -inf, as the reference."""
    q, k, w = _inputs(b, s, h, 32 if device == "cpu" else 128, n, dtype, device, seed=seed)
    if causal_ratio:  # a prefill: query t sees (t + 1) // ratio keys
        visible = ((torch.arange(s, device=device) + 1) // causal_ratio).expand(b, s).contiguous()
    else:
        g = torch.Generator(device=device).manual_seed(seed)
        visible = torch.randint(-3, n + 9, (b, s), generator=g, device=device)  # clamped to [0, N]
    full = indexer_scores_triton(q, k, w, SCALE)
    got = indexer_scores_triton(q, k, w, SCALE, visible)
    hidden = torch.arange(n, device=device) >= visible.clamp(0, n).unsqueeze(-1)
    assert torch.isneginf(got[hidden]).all(), "entries past visible are -inf"
    assert_bitwise(got[~hidden], full[~hidden], "visible entries: the same bits as without visible")
    ref = indexer_scores_ref(q, k, w, SCALE, visible)
    assert torch.isneginf(ref[hidden]).all() and torch.isfinite(ref[~hidden]).all()
    assert_rel_close(got[~hidden], ref[~hidden], 1e-5, f"visible {dtype}")


def _interp_visible(dtype: str) -> None:
    _check_visible(2, 37, 8, 200, getattr(torch, dtype), "cpu", seed=5)  # 37 queries: several spans of 8 tiles
    _check_visible(1, 300, 8, 75, getattr(torch, dtype), "cpu", seed=6, causal_ratio=4)


INTERP_CASES = {
    f"{dt}-h{h}-dh{dh}": ("_interp_matches_reference", (dt, h, dh))
    for dt in ("float32", "bfloat16")
    for h, dh in ((8, 32), (64, 16), (6, 32))  # 6 heads: the reference fallback
}
INTERP_CASES["invariance"] = ("_interp_invariance_in_queries_and_keys", ())
INTERP_CASES["visible-float32"] = ("_interp_visible", ("float32",))
INTERP_CASES["visible-bfloat16"] = ("_interp_visible", ("bfloat16",))


def _check_topk(b, s, n, k, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(b, s, n, generator=g, device=device)
    visible = torch.randint(0, n + 5, (b, s), generator=g, device=device)
    visible[0, 0] = n  # one full row
    mask = torch.rand(b, s, n, generator=g, device=device) < 0.7
    for m in (None, mask):
        got, want = indexer_topk_triton(scores, visible, k, m), indexer_topk_ref(scores, visible, k, m)
        assert torch.equal(got, want), f"indexer_topk mask={m is not None} differs in {(got != want).sum()} slots"


def _interp_topk(b, s, n, k):
    _check_topk(b, s, n, k, "cpu", n)


def _check_paged(b, s, h, dh, rpb, nblk, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    q, _, w = _inputs(b, s, h, dh, 1, dtype, device, seed)
    pool = torch.randn(3 * b * nblk, rpb, dh, generator=g, device=device).to(dtype)
    tables = torch.stack([torch.randperm(pool.shape[0], generator=g, device=device)[:nblk] for _ in range(b)])
    got = indexer_scores_paged_triton(q, pool, tables, w, SCALE)
    dense = indexer_scores_triton(q, pool[tables].view(b, -1, dh), w, SCALE)
    assert_bitwise(got, dense, "paged vs the dense kernel over the gathered keys")
    assert_rel_close(got, indexer_scores_paged_ref(q, pool, tables, w, SCALE), 1e-5, "paged vs reference")


def _interp_paged(dtype: str):
    _check_paged(3, 1, 16, 32, 8, 5, getattr(torch, dtype), "cpu", 7)


INTERP_CASES["paged-float32"] = ("_interp_paged", ("float32",))
INTERP_CASES["paged-bfloat16"] = ("_interp_paged", ("bfloat16",))
INTERP_CASES["topk"] = ("_interp_topk", (2, 3, 300, 40))
INTERP_CASES["topk-k-wider-than-n"] = ("_interp_topk", (1, 2, 30, 64))


def _kept_block_scores(mask, scores, visible, block_size):
    """Per row, the sorted scores of the kept blocks (max over visible non-NaN entries, +inf for the newest)."""
    out = []
    for row, m, v in zip(scores.reshape(-1, scores.shape[-1]), mask.reshape(-1, mask.shape[-1]), visible.reshape(-1)):
        n, v = row.shape[0], max(0, min(int(v), row.shape[0]))
        kept = []
        for blk in sorted({i // block_size for i in range(n) if m[i]}):
            lo, hi = blk * block_size, min((blk + 1) * block_size, v)
            vals = [x for x in row[lo:hi].tolist() if x == x]
            kept.append(float("inf") if blk == (v - 1) // block_size else max(vals, default=float("-inf")))
        out.append(sorted(kept))
    return out


def _check_candidates(b, s, n, block_size, top_blocks, device, seed, ties=False):
    g = torch.Generator(device=device).manual_seed(seed)
    if ties:  # few distinct values: block scores tie at the budget's boundary
        values = torch.tensor([0.0, 0.0, 0.5, 1.0], device=device)
        scores = values[torch.randint(0, 4, (b, s, n), generator=g, device=device)]
    else:
        scores = torch.randn(b, s, n, generator=g, device=device)
        scores[0, 0, ::5] = float("nan")
        scores[0, -1, :] = float("-inf")  # nothing selectable: only the newest block is kept
    visible = torch.randint(-2, n + 3, (b, s), generator=g, device=device)  # clamped to [0, N]
    visible[0, 0], visible[-1, -1] = n, 0
    got = candidate_block_mask_triton(scores, visible, block_size, top_blocks)
    want = candidate_block_mask_ref(scores, visible, block_size, top_blocks)
    assert got.dtype == torch.bool and got.shape == want.shape
    what = f"candidate_block_mask n={n} block={block_size} budget={top_blocks}"
    if ties:
        assert not (got & ~(torch.arange(n, device=device) < visible.clamp(0, n)[..., None])).any(), what
        got_kept = _kept_block_scores(got.cpu(), scores.cpu(), visible.cpu(), block_size)
        assert got_kept == _kept_block_scores(want.cpu(), scores.cpu(), visible.cpu(), block_size), what
    else:
        assert torch.equal(got, want), f"{what}: {(got != want).sum()} positions differ"


def _interp_candidates(n, block_size, top_blocks, ties):
    _check_candidates(2, 5, n, block_size, top_blocks, "cpu", n + block_size, ties)


for _n, _bs, _tb in ((29, 4, 3), (40, 4, 100), (40, 4, 10), (40, 4, 9), (13, 3, 1), (17, 1, 5), (600, 8, 40)):
    INTERP_CASES[f"candidates-n{_n}-b{_bs}-top{_tb}"] = ("_interp_candidates", (_n, _bs, _tb, False))
INTERP_CASES["candidates-ties"] = ("_interp_candidates", (30, 4, 3, True))
INTERP_CASES["candidates-ties-all-fit"] = ("_interp_candidates", (30, 4, 8, True))

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


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "s", "ratio"), [(64, 8192, 4), (32, 8192, 4), (64, 4096, None)])
def test_gpu_visible(h, s, ratio):
    """V4 (64 heads) / V4.1 (32) prefill shapes, causal (query t sees (t + 1) // 4 keys) and random lengths."""
    _check_visible(1, s, h, s // 4, torch.bfloat16, "cuda", seed=h + s, causal_ratio=ratio)


def test_visible_checked():
    q, k, w = _inputs(1, 3, 8, 32, 10, torch.float32, "cpu", seed=1)
    from deepinfer_kernels.ops.indexer import indexer_scores

    with pytest.raises(ValueError, match="visible"):
        indexer_scores(q, k, w, SCALE, torch.zeros(1, 3, dtype=torch.int32))
    assert torch.isneginf(indexer_scores(q, k, w, SCALE, torch.zeros(1, 3, dtype=torch.int64))).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "s", "n"), [(1, 1, 1024), (256, 1, 1280), (1, 512, 8192), (1, 1, 32768)])
def test_gpu_topk_matches_reference(b, s, n):
    _check_topk(b, s, n, 512, "cuda", n + s)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "nblk"), [(1, 33), (256, 40), (8, 264)])
def test_gpu_paged_equals_dense(b, nblk):
    _check_paged(b, 1, 32, 128, 32, nblk, torch.bfloat16, "cuda", b + nblk)  # V4.1: 32 heads, ratio 4, block 128


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "s", "n"), [(1, 1, 4096), (256, 1, 4096), (8, 1, 16384), (1, 1, 32768), (64, 1, 32768),
                                           (1, 512, 8192)])  # fmt: skip
def test_gpu_candidate_block_mask(b, s, n):
    _check_candidates(b, s, n, 8, 2048, "cuda", n + b)  # V4.1: blocks of 8, a budget of 2048 (16K entries)
    if n == 32768:
        _check_candidates(b, s, n, 8, 2048, "cuda", n + b + 1, ties=True)

"""Lightning-indexer ops: scores vs transformers' V4 scorer and a brute force, top-k vs the V4
indexer's selection and by properties under heavy ties, and the V4.1 candidate-block pre-filter
vs a pure-Python brute force."""

import math

import pytest
import torch
from deepinfer_kernels.ops.indexer import candidate_block_mask, indexer_scores, indexer_topk
from deepinfer_kernels.registry import list_ops, reference
from deepinfer_kernels.testing.compare import assert_rel_close

H, DH, HIDDEN = 16, 32, 64
NEG_INF = float("-inf")


def _v4():
    """transformers' DeepSeek-V4 modules and a tiny config (16 index heads, dim 32, hidden 64)."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        hidden_size=HIDDEN, index_n_heads=H, index_head_dim=DH, index_topk=8, q_lora_rank=32,
        num_hidden_layers=2, num_attention_heads=4, head_dim=32, vocab_size=64, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, o_groups=2, o_lora_rank=16,
    )  # fmt: skip
    return modeling, config


def _row_sets(idx: torch.Tensor) -> list[set[int]]:
    return [set(r[r >= 0].tolist()) for r in idx.reshape(-1, idx.shape[-1])]


# ----------------------------------------------------------------------------------------------
# indexer_scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_transformers_scorer(dtype):
    modeling, config = _v4()
    g = torch.Generator().manual_seed(101)
    scorer = modeling.DeepseekV4IndexerScorer(config)
    with torch.no_grad():
        scorer.weights_proj.weight.copy_(torch.randn(H, HIDDEN, generator=g) * 0.2)
    b, s, n = 2, 7, 19
    q = torch.randn(b, s, H, DH, generator=g).to(dtype)
    k = torch.randn(b, n, DH, generator=g).to(dtype)
    hidden = torch.randn(b, s, HIDDEN, generator=g)
    with torch.no_grad():
        expected = scorer(q, k, hidden)
        weights = scorer.weights_proj(hidden).float() * H**-0.5
    actual = indexer_scores(q, k, weights, DH**-0.5)
    assert actual.dtype == torch.float32 and actual.shape == (b, s, n)
    assert (actual > 0).any() and (actual < 0).any()  # weights of both signs exercised
    assert_rel_close(actual, expected, 1e-6, "indexer_scores vs DeepseekV4IndexerScorer")
    # the reference runs the scorer's operation order, but its dot products and head sum are
    # row-invariant reductions rather than the scorer's matmul, so it agrees to rounding, not bitwise
    assert_rel_close(reference("indexer_scores")(q, k, weights, DH**-0.5), expected, 1e-6, "reference vs scorer")


def test_scores_match_brute_force():
    g = torch.Generator().manual_seed(102)
    b, s, h, dh, n = 2, 3, 4, 5, 6
    q = torch.randn(b, s, h, dh, generator=g)
    k = torch.randn(b, n, dh, generator=g)
    w = torch.randn(b, s, h, generator=g)
    scale = dh**-0.5
    expected = torch.zeros(b, s, n, dtype=torch.float64)
    for bi in range(b):
        for si in range(s):
            for ni in range(n):
                total = 0.0
                for hi in range(h):
                    dot = sum(float(q[bi, si, hi, d]) * float(k[bi, ni, d]) for d in range(dh))
                    total += float(w[bi, si, hi]) * max(dot, 0.0) * scale
                expected[bi, si, ni] = total
    actual = indexer_scores(q, k, w, scale)
    assert_rel_close(actual, expected, 1e-6, "indexer_scores vs brute force")
    # ReLU really is applied per head before weighting: a pure dot-product sum would differ
    no_relu = torch.einsum("bshd,bnd,bsh->bsn", q.double(), k.double(), w.double()) * scale
    assert (actual.double() - no_relu).abs().max() > 1e-3


def test_scores_empty_and_validation():
    q, k, w = torch.randn(1, 2, 3, 4), torch.randn(1, 0, 4), torch.randn(1, 2, 3)
    assert indexer_scores(q, k, w, 0.5).shape == (1, 2, 0)
    k = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match="q must be"):
        indexer_scores(q[0], k, w, 0.5)
    with pytest.raises(ValueError, match="k shape"):
        indexer_scores(q, torch.randn(1, 5, 3), w, 0.5)
    with pytest.raises(ValueError, match="weights must be float32"):
        indexer_scores(q, k, w.bfloat16(), 0.5)
    with pytest.raises(ValueError, match="weights shape"):
        indexer_scores(q, k, torch.randn(1, 2, 4), 0.5)


# ----------------------------------------------------------------------------------------------
# indexer_topk


def test_topk_matches_transformers_indexer_selection():
    """Drive DeepseekV4Indexer with our random scores (its scorer stubbed) and compare the sets."""
    modeling, config = _v4()
    g = torch.Generator().manual_seed(201)
    indexer = modeling.DeepseekV4Indexer(config)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    b, s, ratio, top_k = 3, 64, config.compress_rates["compressed_sparse_attention"], config.index_topk
    n = s // ratio  # 16 compressed entries, more than top_k: real selection on late rows
    scores = torch.randn(b, s, n, generator=g)  # continuous: no ties

    class Stub(torch.nn.Module):
        def forward(self, q, compressed_kv, hidden_states):
            assert compressed_kv.shape[1] == n
            return scores.clone()

    indexer.scorer = Stub()
    # row 0 starts at 0; the others start later, so their visible length passes N (clamped)
    positions = torch.arange(s).unsqueeze(0) + torch.tensor([[0], [3], [40]])
    with torch.no_grad():
        expected = indexer(
            torch.randn(b, s, HIDDEN, generator=g), torch.randn(b, s, 32, generator=g), positions, None, 0
        )
    visible = (positions + 1) // ratio
    actual = indexer_topk(scores, visible, top_k)
    assert actual.shape == expected.shape == (b, s, min(top_k, n)) and actual.dtype == torch.int64
    assert _row_sets(actual) == _row_sets(expected)
    assert (expected[0, 0] == -1).all() and (expected[0, -1] >= 0).all()  # both regimes present


def _check_topk_properties(scores, visible, top_k, idx, allowed):
    """allowed: bool [B, S, N] of selectable entries. Checks the whole contract on every row."""
    n = scores.shape[-1]
    assert idx.dtype == torch.int64 and idx.shape == (*scores.shape[:2], min(top_k, n))
    for (bi, si), row in zip(torch.cartesian_prod(*map(torch.arange, idx.shape[:2])).tolist(),
                             idx.reshape(-1, idx.shape[-1])):  # fmt: skip
        picked = row[row >= 0].tolist()
        ok = allowed[bi, si]
        count = min(top_k, int(ok.sum()))
        assert len(picked) == count, (bi, si, row)
        assert row[count:].eq(-1).all() and row[:count].ge(0).all(), "padding must be -1, at the end"
        assert picked == sorted(set(picked)), "ascending, no duplicates"
        assert all(ok[i] for i in picked), "picked an unselectable entry"
        if picked:
            rest = ok.clone()
            rest[picked] = False
            if rest.any():
                assert scores[bi, si, picked].min() >= scores[bi, si][rest].max(), (bi, si)


def _visible_mask(visible, n):
    return torch.arange(n) < visible.clamp(0, n).unsqueeze(-1)


@pytest.mark.parametrize("top_k", [1, 4, 9, 40])
def test_topk_properties_with_many_ties(top_k):
    g = torch.Generator().manual_seed(300 + top_k)
    b, s, n = 4, 24, 23
    values = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.25, 0.5, -0.5, 1.0])  # ReLU-like: zeros dominate
    scores = values[torch.randint(0, len(values), (b, s, n), generator=g)]
    visible = torch.randint(0, n + 4, (b, s), generator=g)  # includes 0 and lengths past N
    visible[0, 0], visible[0, 1] = 0, n
    idx = indexer_topk(scores, visible, top_k)
    _check_topk_properties(scores, visible, top_k, idx, _visible_mask(visible, n))
    assert (scores == 0).float().mean() > 0.4


def test_topk_nan_and_neg_inf_are_never_picked():
    g = torch.Generator().manual_seed(310)
    b, s, n, top_k = 2, 16, 12, 5
    scores = torch.randn(b, s, n, generator=g)
    scores[torch.rand(b, s, n, generator=g) < 0.3] = float("nan")
    scores[torch.rand(b, s, n, generator=g) < 0.2] = NEG_INF
    scores[0, 0, 0] = float("inf")
    visible = torch.randint(0, n + 1, (b, s), generator=g)
    visible[0, 0] = n
    idx = indexer_topk(scores, visible, top_k)
    allowed = _visible_mask(visible, n) & ~scores.isnan() & (scores != NEG_INF)
    _check_topk_properties(scores.masked_fill(scores.isnan(), NEG_INF), visible, top_k, idx, allowed)
    assert 0 in idx[0, 0].tolist()  # +inf is an ordinary, selectable score


def test_topk_masked_selects_only_inside_mask():
    g = torch.Generator().manual_seed(320)
    b, s, n, top_k = 3, 20, 30, 6
    scores = torch.randn(b, s, n, generator=g)
    visible = torch.randint(0, n + 1, (b, s), generator=g)
    mask = torch.rand(b, s, n, generator=g) < 0.4
    idx = indexer_topk(scores, visible, top_k, mask=mask)
    _check_topk_properties(scores, visible, top_k, idx, _visible_mask(visible, n) & mask)
    unmasked = indexer_topk(scores, visible, top_k)
    assert not torch.equal(idx, unmasked)  # the mask really changed the selection
    # identical to treating the outside of the mask as -inf
    assert torch.equal(idx, indexer_topk(scores.masked_fill(~mask, NEG_INF), visible, top_k))


def test_topk_edges_and_validation():
    scores, visible = torch.randn(2, 3, 5), torch.tensor([[0, 2, 5], [9, 1, 3]])
    assert indexer_topk(scores, visible, 0).shape == (2, 3, 0)
    assert indexer_topk(torch.randn(2, 3, 0), visible, 4).shape == (2, 3, 0)
    assert indexer_topk(scores, visible, 7)[0, 0].tolist() == [-1] * 5
    assert indexer_topk(scores, visible, 7)[1, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="scores must be float32"):
        indexer_topk(scores.double(), visible, 2)
    with pytest.raises(ValueError, match="visible must be int64"):
        indexer_topk(scores, visible.int(), 2)
    with pytest.raises(ValueError, match="visible shape"):
        indexer_topk(scores, visible[0], 2)
    with pytest.raises(ValueError, match="top_k"):
        indexer_topk(scores, visible, -1)
    with pytest.raises(ValueError, match="mask must be bool"):
        indexer_topk(scores, visible, 2, mask=torch.ones(2, 3, 5))
    with pytest.raises(ValueError, match="mask shape"):
        indexer_topk(scores, visible, 2, mask=torch.ones(2, 3, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------
# candidate_block_mask


def _brute_blocks(row: list[float], vis: int, block_size: int, top_blocks: int):
    """Pure Python, one row: (forced block or None, [(score, block) of the other finite blocks sorted
    descending], number of non-forced slots)."""
    n = len(row)
    vis = max(0, min(vis, n))
    n_blocks = math.ceil(n / block_size)
    forced = (vis - 1) // block_size if vis > 0 else None
    others = []
    for blk in range(n_blocks):
        vals = [row[i] for i in range(blk * block_size, min((blk + 1) * block_size, vis)) if not math.isnan(row[i])]
        best = max(vals, default=NEG_INF)
        if blk != forced and best > NEG_INF:
            others.append((best, blk))
    others.sort(key=lambda t: -t[0])
    slots = min(top_blocks, n_blocks) - (forced is not None)
    return forced, others, slots


def _check_candidate_rows(scores, visible, block_size, top_blocks, mask):
    """Checks every row against the brute force; returns how many rows were pinned down exactly."""
    b, s, n = scores.shape
    assert mask.dtype == torch.bool and mask.shape == scores.shape
    n_exact = 0
    for bi in range(b):
        for si in range(s):
            vis = int(visible[bi, si])
            forced, others, slots = _brute_blocks(scores[bi, si].tolist(), vis, block_size, top_blocks)
            m = mask[bi, si].tolist()
            assert not any(m[max(vis, 0) :]), "invisible position in the mask"
            kept = {i // block_size for i in range(n) if m[i]}
            for blk in kept:  # a kept block is kept on all its visible positions
                lo, hi = blk * block_size, min((blk + 1) * block_size, vis, n)
                assert all(m[lo:hi]), (bi, si, blk)
            if forced is None:
                assert not kept
                n_exact += 1
                continue
            assert forced in kept, "the newest visible block must always be kept"
            chosen = kept - {forced}
            assert len(chosen) == min(slots, len(others)), (bi, si, kept, slots)
            score_of = dict((blk, sc) for sc, blk in others)
            assert chosen <= set(score_of), "kept a block with no finite visible score"
            dropped = [score_of[blk] for blk in score_of if blk not in chosen]
            if chosen and dropped:
                assert min(score_of[blk] for blk in chosen) >= max(dropped), (bi, si)
            untied = len(others) <= slots or slots == 0 or others[slots - 1][0] > others[slots][0]
            if untied:
                n_exact += 1
                assert chosen == {blk for _, blk in others[: max(slots, 0)]}, (bi, si)
    return n_exact


@pytest.mark.parametrize(
    "n,block_size,top_blocks",
    [(29, 4, 3), (32, 8, 2), (13, 3, 1), (17, 1, 5), (8, 8, 4), (40, 4, 100), (40, 4, 10), (40, 4, 9)],
)  # the last three: a budget above, at and one below the block count
def test_candidate_block_mask_brute_force_continuous(n, block_size, top_blocks):
    g = torch.Generator().manual_seed(400 + n * 7 + block_size)
    b, s = 3, 12
    scores = torch.randn(b, s, n, generator=g)
    visible = torch.randint(0, n + 3, (b, s), generator=g)
    visible[0, 0], visible[0, 1], visible[0, 2] = 0, 1, n
    mask = candidate_block_mask(scores, visible, block_size, top_blocks)
    n_exact = _check_candidate_rows(scores, visible, block_size, top_blocks, mask)
    assert n_exact == b * s  # continuous scores: (almost) every row is checked exactly


@pytest.mark.parametrize("n,block_size,top_blocks", [(24, 4, 2), (30, 4, 3), (16, 2, 1), (21, 5, 2), (21, 5, 5)])
def test_candidate_block_mask_brute_force_ties(n, block_size, top_blocks):
    g = torch.Generator().manual_seed(500 + n + block_size)
    b, s = 3, 16
    values = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0])
    scores = values[torch.randint(0, len(values), (b, s, n), generator=g)]
    visible = torch.randint(0, n + 1, (b, s), generator=g)
    mask = candidate_block_mask(scores, visible, block_size, top_blocks)
    _check_candidate_rows(scores, visible, block_size, top_blocks, mask)


def test_candidate_forced_block_wins_ties_and_takes_a_slot():
    # every score equal: without the pin, the newest block would lose the tie to older blocks
    b, s, n, block_size = 1, 3, 32, 4
    scores = torch.zeros(b, s, n)
    visible = torch.tensor([[32, 23, 5]])
    mask = candidate_block_mask(scores, visible, block_size, 1)
    for si, vis in enumerate(visible[0].tolist()):
        newest = (vis - 1) // block_size
        expect = [(i // block_size == newest) and i < vis for i in range(n)]
        assert mask[0, si].tolist() == expect, si
    # the newest block scores lowest: it is kept anyway and the one remaining slot goes to the best
    scores = torch.arange(n, 0, -1, dtype=torch.float32).expand(b, s, n).contiguous()  # block 0 best
    mask = candidate_block_mask(scores, visible, block_size, 2)
    for si, vis in enumerate(visible[0].tolist()):
        newest = (vis - 1) // block_size
        blocks = {i // block_size for i in range(n) if mask[0, si, i]}
        assert blocks == {0, newest} if newest else blocks == {0}, (si, blocks)


def test_candidate_mask_then_masked_topk():
    g = torch.Generator().manual_seed(600)
    b, s, n, block_size, top_blocks, top_k = 2, 24, 45, 4, 3, 7
    src = torch.randn(b, s, n, generator=g)  # layer 20's scores
    reindex = torch.randn(b, s, n, generator=g)  # a re-index layer's own scores
    visible = torch.randint(0, n + 1, (b, s), generator=g)
    cand = candidate_block_mask(src, visible, block_size, top_blocks)
    idx = indexer_topk(reindex, visible, top_k, mask=cand)
    _check_topk_properties(reindex, visible, top_k, idx, cand)
    for row_idx, row_mask in zip(idx.reshape(-1, idx.shape[-1]), cand.reshape(-1, n)):
        assert all(row_mask[i] for i in row_idx[row_idx >= 0].tolist())


def test_candidate_edges_and_validation():
    scores, visible = torch.randn(2, 2, 6), torch.tensor([[0, 6], [3, 100]])
    scores[:, :, :4] += 10.0  # block 0 outscores the newest block, which must still win the slot
    mask = candidate_block_mask(scores, visible, 4, 1)
    assert mask[0, 0].tolist() == [False] * 6
    assert mask[0, 1].tolist() == [False] * 4 + [True] * 2  # newest block only (budget 1)
    assert mask[1, 1].tolist() == [False] * 4 + [True] * 2  # visible past N clamps to N
    assert candidate_block_mask(torch.randn(2, 2, 0), visible, 4, 3).shape == (2, 2, 0)
    with pytest.raises(ValueError, match="block_size"):
        candidate_block_mask(scores, visible, 0, 1)
    with pytest.raises(ValueError, match="top_blocks"):
        candidate_block_mask(scores, visible, 4, 0)
    with pytest.raises(ValueError, match="visible must be int64"):
        candidate_block_mask(scores, visible.float(), 4, 1)


def test_registered_under_function_names():
    ops = list_ops()
    for name in ("indexer_scores", "indexer_topk", "candidate_block_mask"):
        assert name in ops
        assert reference(name).__module__.endswith("ops.indexer.reference")

"""Lightning indexer: head-weighted ReLU scores, top-k selection of compressed entries, and the
V4.1 two-level pre-filter (candidate blocks published by layer 20, honoured by layers 24/28/32/36).

Shared conventions of the four functions:

* ``visible`` [B, S] int64 is the number of compressed entries query (b, s) may see: entry n is
  visible iff ``n < visible[b, s]`` (V4: floor((t+1)/4); V4.1: floor((t+1)/ratio)). Values are
  clamped to [0, N] (no host sync to validate them), so a length past the end means "all N".
* An entry is *selectable* when it is visible, inside ``mask`` (when one is given) and its score is
  neither NaN nor -inf. NaN and -inf scores are treated exactly like invisible entries: they are
  never picked and never make a block count. (V4.1 drops -inf picks; V4 would keep a -inf pick at a
  visible position, which ReLU scores never produce, so the two agree on real scores.)
* Ties: among equal scores the choice is unspecified (the reference uses ``torch.topk``), so any
  implementation may pick any of the tied entries. Tests check properties, not indices, on ties.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)


def _check_scores_visible(fn: str, scores: torch.Tensor, visible: torch.Tensor) -> None:
    if scores.dim() != 3:
        raise ValueError(f"{fn}: scores must be [B, S, N], got shape {tuple(scores.shape)}")
    if scores.dtype != torch.float32:
        raise ValueError(f"{fn}: scores must be float32, got {scores.dtype}")
    if visible.shape != scores.shape[:2]:
        raise ValueError(f"{fn}: visible shape {tuple(visible.shape)} must be [B, S] = {tuple(scores.shape[:2])}")
    if visible.dtype != torch.int64:
        raise ValueError(f"{fn}: visible must be int64, got {visible.dtype}")


def _check_count(fn: str, name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{fn}: {name} must be an int >= {minimum}, got {value!r}")


def _check_row_map(fn: str, row_map: tuple, scores: torch.Tensor) -> None:
    """``indexer_topk``'s row_map: (tables int64 [B, W], rows_per_block >= 1, offset >= 0, prefix int64 [B, P] or
    None), the tensors on scores' device (``paged_rows``'s arguments, B = scores' requests)."""
    if not isinstance(row_map, (tuple, list)) or len(row_map) != 4:
        raise ValueError(f"{fn}: row_map must be (tables, rows_per_block, offset, prefix), got {row_map!r}")
    tables, rows_per_block, offset, prefix = row_map
    b = scores.shape[0]
    if not isinstance(tables, torch.Tensor) or tables.dim() != 2 or tables.dtype != torch.int64:
        got = f"{tables.dtype}{tuple(tables.shape)}" if isinstance(tables, torch.Tensor) else repr(tables)
        raise ValueError(f"{fn}: row_map's tables must be int64 [B, W], got {got}")
    if tables.shape[0] != b or tables.device != scores.device:
        raise ValueError(
            f"{fn}: row_map's tables {tuple(tables.shape)} on {tables.device} must be [B={b}, W] on {scores.device}"
        )
    _check_count(fn, "row_map's rows_per_block", rows_per_block, 1)
    _check_count(fn, "row_map's offset", offset, 0)
    if prefix is not None and (
        not isinstance(prefix, torch.Tensor)
        or prefix.dim() != 2
        or prefix.dtype != torch.int64
        or prefix.shape[0] != b
        or prefix.device != scores.device
    ):
        got = f"{prefix.dtype}{tuple(prefix.shape)} on {prefix.device}" if isinstance(prefix, torch.Tensor) else prefix
        raise ValueError(f"{fn}: row_map's prefix must be None or int64 [B={b}, P] on {scores.device}, got {got}")


def indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """I[b,s,n] = sum_h weights[b,s,h] * relu(q[b,s,h] . k[b,n]) * softmax_scale, in fp32.

    Operation order (fixed, so fp32 results agree with transformers' DeepseekV4IndexerScorer to
    ~1e-6): fp32 dot products, ReLU, times ``softmax_scale``, times the head weight, sum over heads.
    Without ``visible`` every entry gets its score (``indexer_topk`` and ``candidate_block_mask`` apply
    visibility). With ``visible`` [B, S] int64 (the same lengths those take, clamped to [0, N]), entries
    n >= visible[b, s] are -inf instead, which both treat as invisible, and backends may skip computing them:
    a causal prefill's queries see about half the keys.

    Args:
        q: [B, S, H, Dh] indexer queries (after RoPE and any FP4 simulation), any float dtype;
            upcast to fp32.
        k: [B, N, Dh] index keys of the compressed entries, any float dtype; upcast to fp32.
        weights: [B, S, H] fp32 per-head weights, already multiplied by H^-0.5 by the caller
            (V4: weights_proj(x) * 64^-0.5; V4.1: * 32^-0.5).
        softmax_scale: Dh^-0.5 (128^-0.5 for both models).

    Returns:
        [B, S, N] fp32. N = 0 gives an empty [B, S, 0]. See reference.py.
    """
    fn = "indexer_scores"
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must be [B, S, H, Dh], got shape {tuple(q.shape)}")
    if k.dim() != 3:
        raise ValueError(f"{fn}: k must be [B, N, Dh], got shape {tuple(k.shape)}")
    if weights.dim() != 3:
        raise ValueError(f"{fn}: weights must be [B, S, H], got shape {tuple(weights.shape)}")
    if not q.is_floating_point() or not k.is_floating_point():
        raise ValueError(f"{fn}: q and k must be floating point, got {q.dtype} and {k.dtype}")
    if weights.dtype != torch.float32:
        raise ValueError(f"{fn}: weights must be float32, got {weights.dtype}")
    b, s, h, dh = q.shape
    if k.shape[0] != b or k.shape[2] != dh:
        raise ValueError(f"{fn}: k shape {tuple(k.shape)} must be [B={b}, N, Dh={dh}] to match q")
    if weights.shape != (b, s, h):
        raise ValueError(f"{fn}: weights shape {tuple(weights.shape)} must be [B, S, H] = {(b, s, h)}")
    if visible is not None and (visible.shape != (b, s) or visible.dtype != torch.int64):
        raise ValueError(f"{fn}: visible must be int64 [B, S] = {(b, s)}, got {visible.dtype}{tuple(visible.shape)}")
    if visible is None:
        return dispatch(fn, q.device, q, k, weights, float(softmax_scale))
    return dispatch(fn, q.device, q, k, weights, float(softmax_scale), visible)


def indexer_scores_paged(
    q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """``indexer_scores`` with every request's keys read in place from a paged pool through its block table.

    Key n of request b is ``pool[tables[b, n // R], n % R]`` (R = rows per block), n < nblk * R: what
    ``indexer_scores(q, pool[tables].view(B, -1, Dh), ...)`` computes, without the gathered copy (a decode step at
    batch 256 and 32K tokens would copy half a GB per indexer layer). Bitwise equal to it on every backend that
    serves both (the Triton kernel only changes how a key row is addressed).

    Args:
        q: [B, S, H, Dh] indexer queries, any float dtype.
        pool: [num_blocks, R, Dh] index keys of every request, the dtype of q or any float dtype.
        tables: [B, nblk] int64 block ids (entries past a request's own are scored like any other: mask them
            with ``visible`` in ``indexer_topk``).
        weights: [B, S, H] fp32 per-head weights (times H^-0.5).
        softmax_scale: Dh^-0.5.

    Returns:
        [B, S, nblk * R] fp32.
    """
    fn = "indexer_scores_paged"
    if pool.dim() != 3 or tables.dim() != 2 or tables.dtype != torch.int64:
        raise ValueError(
            f"{fn}: need pool [num_blocks, R, Dh] and int64 tables [B, nblk]; got {tuple(pool.shape)}, "
            f"{tuple(tables.shape)} {tables.dtype}"
        )
    if q.dim() != 4 or tables.shape[0] != q.shape[0] or pool.shape[2] != q.shape[3]:
        raise ValueError(f"{fn}: q {tuple(q.shape)} must be [B={tables.shape[0]}, S, H, Dh={pool.shape[2]}]")
    if weights.dtype != torch.float32 or weights.shape != q.shape[:3]:
        raise ValueError(f"{fn}: weights must be fp32 [B, S, H] = {tuple(q.shape[:3])}, got {tuple(weights.shape)}")
    return dispatch(fn, q.device, q, pool, tables, weights, float(softmax_scale))


def indexer_topk(
    scores: torch.Tensor,
    visible: torch.Tensor,
    top_k: int,
    mask: torch.Tensor | None = None,
    *,
    row_map: tuple[torch.Tensor, int, int, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Indices of the top-``top_k`` selectable scores per query row, ascending, -1 padded; with ``row_map``, the
    attention row table of those picks instead.

    Selectable = visible (n < visible[b, s]) and, when ``mask`` is given, mask[b, s, n] is True,
    and the score is not NaN / -inf (see the module docstring). ``mask`` is how the V4.1 re-index
    layers (24, 28, 32, 36) restrict their selection to layer 20's ``candidate_block_mask``;
    layer 20 itself and every V4 layer pass ``mask=None``.

    Output order (contract): the selected indices in ascending order, then -1 for every slot that
    no selectable entry can fill (fewer than min(top_k, N) selectable entries). So each row holds
    min(top_k, #selectable) distinct indices followed by -1s. DeepSeek V4.1 re-sorts its picks
    ascending; V4 consumers do not depend on the order.

    Ties: which of several equal scores is taken at the boundary is unspecified.

    Row map (a decode step's attention row table, made by the top-k itself: the ``paged_rows`` launch after it is
    saved): ``row_map`` = (tables, rows_per_block, offset, prefix) are ``paged_rows``' arguments, and the result is
    exactly ``paged_rows(ids[:, s], tables, rows_per_block, offset, prefix=prefix)`` for each query row s, where
    ids = indexer_topk(scores, visible, top_k, mask) (so the same picks, ties included, as this call without a map on
    the same backend). With R = rows_per_block, P = prefix's width (0 when None) and K = min(top_k, N):

        out[b, s, c]     = prefix[b, c]                                  for c < P
        out[b, s, P + j] = tables[b, e // R] * R + e % R + offset        for e = ids[b, s, j] >= 0 with e // R < W
                         = -1                                            for e = -1 or e // R >= W.

    Args:
        scores: [B, S, N] fp32 (e.g. from ``indexer_scores``).
        visible: [B, S] int64 visible lengths (clamped to [0, N]).
        top_k: int >= 0 (V4 and V4.1: 512); the output width is min(top_k, N).
        mask: optional bool [B, S, N]; False entries are treated as invisible.
        row_map: optional (tables, rows_per_block, offset, prefix): tables int64 [B, W] block tables (block ids
            >= 0); rows_per_block int >= 1; offset int >= 0 added to every row (the pool as the row table's second
            segment); prefix None or int64 [B, P] (the first segment: each request's window rows); tensors on
            scores' device.

    Returns:
        [B, S, min(top_k, N)] int64; with ``row_map`` [B, S, P + min(top_k, N)] int64. See reference.py.
    """
    fn = "indexer_topk"
    _check_scores_visible(fn, scores, visible)
    _check_count(fn, "top_k", top_k, 0)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"{fn}: mask must be bool, got {mask.dtype}")
        if mask.shape != scores.shape:
            raise ValueError(f"{fn}: mask shape {tuple(mask.shape)} != scores shape {tuple(scores.shape)}")
    if row_map is None:
        return dispatch(fn, scores.device, scores, visible, top_k, mask)
    _check_row_map(fn, row_map, scores)
    return dispatch(fn, scores.device, scores, visible, top_k, mask, tuple(row_map))


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int) -> torch.Tensor:
    """V4.1 level-one pre-filter (layer 20, spec B.3.4): a per-position mask of the kept blocks.

    Blocks are ``block_size`` consecutive entries (the last one padded with -inf up to a multiple
    of ``block_size``). A block's score is the max over its selectable entries (-inf if none).
    The block holding the newest visible entry, (visible - 1) // block_size, is always kept: it
    is pinned to +inf and **takes one of the ``top_blocks`` slots** (it is part of the budget, not
    an extra block). The remaining slots go to the highest-scoring other blocks with a finite
    score. So a row keeps min(top_blocks, #eligible) blocks, eligible = the newest block plus every
    block with a selectable entry (with finite visible scores: every block holding a visible
    entry). The block mask is expanded to positions and ANDed with visibility.

    Why the forced block is inside the budget: model_v41_flash.md section 3.4 ("always kept (its
    score is set to +inf)" then "The top 2048 blocks are kept, i.e. at most 16,384 positions") and
    model_v41_flash_as_in_vllm.md section 3.7 ("pinned to +inf. Keep the top
    candidate_topk_blocks = 2048 blocks"); transformers main's V4.1 port pins the block to +inf
    before a single top-k(min(topk_blocks, n_blocks)) in the same way.

    Ties among non-pinned blocks at the boundary: which block is kept is unspecified.

    Args:
        scores: [B, S, N] fp32 indexer scores of the candidate-source layer (unmasked; this
            function applies ``visible``).
        visible: [B, S] int64 visible lengths (clamped to [0, N]); a 0 gives an all-False row.
        block_size: int >= 1 (V4.1: 8).
        top_blocks: int >= 1 (V4.1: 2048).

    Returns:
        bool [B, S, N]; True exactly on the visible entries of the kept blocks. See reference.py.
    """
    fn = "candidate_block_mask"
    _check_scores_visible(fn, scores, visible)
    _check_count(fn, "block_size", block_size, 1)
    _check_count(fn, "top_blocks", top_blocks, 1)
    return dispatch(fn, scores.device, scores, visible, block_size, top_blocks)


try:  # the Triton backends register themselves on import; triton is optional (CPU-only installs have none)
    from . import candidate_triton as _candidate_triton  # noqa: F401
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

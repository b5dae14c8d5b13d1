"""Plain-PyTorch lightning-indexer scores, top-k selection and the V4.1 candidate-block pre-filter
(the definition of correct; the contracts are in ``__init__.py``)."""

import torch
import torch.nn.functional as F

from deepinfer_kernels.registry import register_reference

from ..cache_rows.reference import paged_rows_ref

_NEG_INF = float("-inf")


def _selectable(scores: torch.Tensor, visible: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """bool [B, S, N]: n < visible (clamped to [0, N]), inside ``mask``, and a score that is not NaN."""
    n = scores.shape[-1]
    entry = torch.arange(n, device=scores.device)
    keep = entry < visible.to(scores.device).clamp(0, n).unsqueeze(-1)
    if mask is not None:
        keep = keep & mask
    return keep & ~scores.isnan()


# bytes of the fp32 [queries, keys, H, Dh] product held at once by ``indexer_scores_ref``
_SCORES_CHUNK_BYTES = 64 << 20


@register_reference("indexer_scores")
def indexer_scores_ref(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None = None
) -> torch.Tensor:
    # The trained model's operation order (transformers' V4 scorer): per-head dot products in fp32,
    # ReLU, times the softmax scale, times the per-head weight, sum over heads. Unlike the scorer's
    # matmul, the dot products are elementwise products summed over Dh, and the head sum a sum over
    # a contiguous last dim: both are reductions over one output's own values with a fixed length,
    # so a score's bits depend only on its query row and its key - not on how many queries or keys
    # (keys grow during decode) are in the call, nor on the chunking below (bounded memory).
    b, s, h, dh = q.shape
    n = k.shape[1]
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    qf, kf, wf = q.float(), k.float(), weights.float()
    pair_bytes = 4 * h * max(dh, 1)  # one (query, key) slice of the product
    keys_per_chunk = min(n, max(1, _SCORES_CHUNK_BYTES // pair_bytes))
    queries_per_chunk = max(1, _SCORES_CHUNK_BYTES // (pair_bytes * keys_per_chunk))
    for bi in range(b):
        for s0 in range(0, s, queries_per_chunk):
            qc = qf[bi, s0 : s0 + queries_per_chunk]  # [sq, H, Dh]
            wc = wf[bi, s0 : s0 + queries_per_chunk].unsqueeze(1)  # [sq, 1, H]
            for n0 in range(0, n, keys_per_chunk):
                kc = kf[bi, n0 : n0 + keys_per_chunk]  # [nk, Dh]
                logits = (qc.unsqueeze(1) * kc[None, :, None, :]).sum(dim=-1)  # [sq, nk, H]
                logits = torch.relu(logits) * softmax_scale
                out[bi, s0 : s0 + queries_per_chunk, n0 : n0 + keys_per_chunk] = (logits * wc).sum(dim=-1)
    if visible is not None:
        hidden = torch.arange(n, device=out.device) >= visible.to(out.device).clamp(0, n).unsqueeze(-1)
        out.masked_fill_(hidden, _NEG_INF)
    return out


@register_reference("indexer_scores_paged")
def indexer_scores_paged_ref(
    q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    keys = pool[tables].view(tables.shape[0], -1, pool.shape[-1])
    return indexer_scores_ref(q, keys, weights, softmax_scale)


@register_reference("indexer_topk")
def indexer_topk_ref(
    scores: torch.Tensor, visible: torch.Tensor, top_k: int, mask: torch.Tensor | None = None, row_map=None
) -> torch.Tensor:
    if row_map is not None:  # the composition: the picks, then each query row's paged_rows
        ids = indexer_topk_ref(scores, visible, top_k, mask)
        tables, rows_per_block, offset, prefix = row_map
        b, s, k = ids.shape
        if s == 0:
            return ids.new_empty(b, 0, k + (0 if prefix is None else prefix.shape[1]))
        rows = [paged_rows_ref(ids[:, i], tables, rows_per_block, offset, prefix=prefix) for i in range(s)]
        return torch.stack(rows, dim=1)
    n = scores.shape[-1]
    k = min(top_k, n)
    selectable = _selectable(scores, visible, mask)
    masked = scores.masked_fill(~selectable, _NEG_INF)
    values, picks = masked.topk(k, dim=-1, sorted=False)
    # a pick is real only when it carries a selectable score (-inf picks fill rows with fewer than
    # k candidates, at arbitrary indices); park the others at n so the ascending sort puts them last
    picks = torch.where(values > _NEG_INF, picks, torch.full_like(picks, n))
    picks = picks.sort(dim=-1).values
    return torch.where(picks == n, torch.full_like(picks, -1), picks)


@register_reference("candidate_block_mask")
def candidate_block_mask_ref(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int
) -> torch.Tensor:
    b, s, n = scores.shape
    n_blocks = -(-n // block_size)
    vis = visible.to(scores.device).clamp(0, n)
    selectable = _selectable(scores, vis, None)
    padded = F.pad(scores.masked_fill(~selectable, _NEG_INF), (0, n_blocks * block_size - n), value=_NEG_INF)
    block_scores = padded.view(b, s, n_blocks, block_size).amax(dim=-1)
    # the block of the newest visible entry is pinned to +inf so it always wins a slot of the budget;
    # rows with nothing visible get newest = -1, which matches no block
    newest = torch.div(vis - 1, block_size, rounding_mode="floor")
    blocks = torch.arange(n_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(blocks == newest.unsqueeze(-1), float("inf"))
    if top_blocks >= n_blocks:  # the budget holds every block (V4.1 up to 16K entries): no ranking to do
        keep = block_scores > _NEG_INF
    else:
        values, picks = block_scores.topk(top_blocks, dim=-1, sorted=False)
        keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, picks, values > _NEG_INF)
    per_position = keep.repeat_interleave(block_size, dim=-1)[..., :n]
    entry = torch.arange(n, device=scores.device)
    return per_position & (entry < vis.unsqueeze(-1))

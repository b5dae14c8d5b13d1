"""Plain-PyTorch sparse multi-query attention with sinks (the definition of correct).

Row-invariant by construction: each query row is computed over exactly its valid entries, in the
order given, so its result does not depend on how much -1 padding the row carries nor on the other
rows. Rows with the same number of valid entries are batched together (same shapes, same kernels).
"""

import torch

from deepinfer_kernels.ops._reduce import row_softmax, row_sum
from deepinfer_kernels.registry import register_reference


def _attend(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, H, D], keys [R, K, D] (all valid) -> [R, H, D] fp32.

    Every reduction (q.k over D, the softmax denominator, the weighted sum over K) is a row_sum over a
    contiguous last dim, so a row's bits never depend on how many rows share the call (CPU and CUDA)."""
    scores = row_sum(q[:, :, None, :] * keys[:, None, :, :]).squeeze(-1) * scale  # [R, H, K]
    sink = sinks.view(1, -1, 1).expand(q.shape[0], -1, 1)
    # the sink joins the max and the denominator but has no value
    probs = row_softmax(torch.cat([scores, sink], dim=-1))[..., :-1]
    return row_sum(probs[:, :, None, :] * keys.transpose(1, 2)[:, None, :, :]).squeeze(-1)  # [R, H, D]


def _used_rows(segments: list[torch.Tensor], indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments addressed as their concatenation -> (the rows ``indices`` use, in ascending order [U, D], indices
    into them). The same values as concatenating, without copying a whole pool per call."""
    used = indices[indices >= 0].unique()  # sorted
    rows, start = [], 0
    for seg in segments:
        mine = used[(used >= start) & (used < start + seg.shape[0])] - start
        rows.append(seg[mine])
        start += seg.shape[0]
    remapped = torch.searchsorted(used, indices.clamp(min=0))
    return torch.cat(rows), torch.where(indices >= 0, remapped, -1)


@register_reference("sparse_mqa_attention")
def sparse_mqa_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    if isinstance(kv, (tuple, list)):  # segments: the rows the indices use, gathered (not the whole pool)
        kv, indices = _used_rows(list(kv), indices)
    t, h, d = q.shape
    out = torch.zeros(t, h, d, dtype=torch.float32, device=q.device)
    valid = indices >= 0
    counts = valid.sum(dim=1)
    # valid slots first, in their original order (stable), so a row's entries keep their order
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    packed = torch.gather(indices, 1, order)
    qf, kvf, sinkf = q.float(), kv.float(), sinks.float()
    for k in counts.unique().tolist():
        if k == 0:  # only the sink: the output is zero
            continue
        rows = (counts == k).nonzero().squeeze(1)
        keys = kvf[packed[rows, :k]]
        out[rows] = _attend(qf[rows], keys, sinkf, scale)
    return out.to(q.dtype)

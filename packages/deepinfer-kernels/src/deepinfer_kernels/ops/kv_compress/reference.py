"""Plain-PyTorch KV compression pooling (the definition of correct)."""

import torch

from deepinfer_kernels.ops._reduce import row_softmax, row_sum
from deepinfer_kernels.registry import register_reference


@register_reference("kv_compress_pool")
def kv_compress_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [..., L, C] -> [..., C]: the slots' kv weighted by the softmax of their scores over L.

    Both reductions run over a contiguous last dim with ``row_sum``: torch's softmax / sum over dim -2 split the
    slots across CPU threads when there are few outputs (a decode step), so a group's bits changed with the
    batch on a many-core host."""
    weights = row_softmax(score.float().transpose(-1, -2))  # [..., C, L]
    return row_sum(kv.float().transpose(-1, -2) * weights).squeeze(-1).to(kv.dtype)


@register_reference("kv_compress_pool_rows")
def kv_compress_pool_rows_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    rows: torch.Tensor,
    lead: int,
    width: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gather each group's slots ([B, L, C]; empty slots kv 0, score -inf) and pool them (``kv_compress_pool_ref``)."""
    ck = kv.shape[1]
    held = (rows >= 0)[..., None]
    safe = rows.clamp(min=0)

    def gather(t: torch.Tensor, empty: float) -> torch.Tensor:
        g = t[safe]  # [B, L, Ck]
        g = torch.cat([g[:, :lead, :width], g[:, lead:, ck - width :]], dim=1)
        return torch.where(held, g, torch.full((), empty, dtype=t.dtype, device=t.device))

    pooled = kv_compress_pool_ref(gather(kv, 0.0), gather(score, float("-inf")))
    return pooled if out_dtype is None else pooled.to(out_dtype)

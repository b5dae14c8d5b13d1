"""Plain-PyTorch expert permutation (the definition of correct). Stable sort, exact gathers, and a slot-order
sum of separately rounded fp32 products (mul, then add), so every token's bits depend on its own rows only."""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("moe_sort")
def moe_sort_ref(experts: torch.Tensor, num_experts: int):
    flat = experts.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    # offsets[e] = number of ids below e (bincount would size its output from a host read of the largest id)
    offsets = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=flat.device))
    return order, offsets


@register_reference("moe_permute")
def moe_permute_ref(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    order, offsets = moe_sort_ref(experts, num_experts)
    return x[order // experts.shape[1]], order, offsets


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """pos with pos[order[j]] = j (int64)."""
    pos = torch.empty_like(order, dtype=torch.int64)
    pos[order.long()] = torch.arange(order.shape[0], device=order.device)
    return pos


@register_reference("moe_sort_rows")
def moe_sort_rows_ref(experts: torch.Tensor, weights: torch.Tensor, num_experts: int):
    order, offsets = moe_sort_ref(experts, num_experts)
    return order, offsets, inverse_order(order), order // experts.shape[1], weights.reshape(-1).float()[order]


@register_reference("moe_unpermute")
def moe_unpermute_ref(y, order, num_tokens, weights=None, out_dtype=None, *, inverse=None):
    p, d = y.shape
    k = p // num_tokens
    pos = inverse if inverse is not None else None if order is None else inverse_order(order)
    rows = y.float() if pos is None else y.float()[pos.long()]
    rows = rows.view(num_tokens, k, d)
    w = None if weights is None else weights.float()
    out = rows[:, 0] if w is None else rows[:, 0] * w[:, :1]
    for i in range(1, k):
        out = out + (rows[:, i] if w is None else rows[:, i] * w[:, i : i + 1])
    return out.to(out_dtype or y.dtype)

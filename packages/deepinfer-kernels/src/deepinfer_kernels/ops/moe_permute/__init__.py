"""Routing data movement for grouped expert GEMMs: sort (token, slot) pairs by expert and gather their rows
(``moe_permute``), and scatter the expert outputs back to tokens with a weighted sum in a fixed order
(``moe_unpermute``). Pair p = t * k + i is slot i of token t."""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)


def moe_sort(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sort of ``moe_permute`` without moving rows: (order [T * k] int64, expert_offsets [E + 1] int64), as
    ``moe_permute`` returns them. For a grouped GEMM that reads each sorted row of x in place (``row_index`` =
    order // k) instead of a sorted copy of x."""
    if experts.dim() != 2 or experts.is_floating_point():
        raise ValueError(f"moe_sort: experts must be integer [T, k], got {experts.dtype}{tuple(experts.shape)}")
    if num_experts < 1:
        raise ValueError(f"moe_sort: num_experts must be positive, got {num_experts}")
    return dispatch("moe_sort", experts.device, experts, num_experts)


def moe_sort_rows(
    experts: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_sort`` plus what a grouped GEMM over the sorted rows and the unpermute read beside it.

    Args:
        experts: [T, k] integer expert ids in [0, num_experts) (not validated on the device).
        weights: [T, k] floating point routing weights.
        num_experts: E.

    Returns:
        (order [P] int64, expert_offsets [E + 1] int64: as ``moe_sort``; inverse [P] int64: the sorted row of each
        pair (inverse[order[j]] = j, for ``moe_unpermute``'s ``inverse``); row_token [P] int64: the token of each
        sorted row (order // k); row_weight [P] fp32: its routing weight (weights.flatten()[order])), P = T * k,
        all exactly these torch expressions' values. The GPU backend builds them in one launch at decode sizes.
    """
    if experts.dim() != 2 or experts.is_floating_point():
        raise ValueError(f"moe_sort_rows: experts must be integer [T, k], got {experts.dtype}{tuple(experts.shape)}")
    if tuple(weights.shape) != tuple(experts.shape) or not weights.is_floating_point():
        raise ValueError(f"moe_sort_rows: weights must be floating point {tuple(experts.shape)}, got "
                         f"{weights.dtype}{tuple(weights.shape)}")  # fmt: skip
    if num_experts < 1:
        raise ValueError(f"moe_sort_rows: num_experts must be positive, got {num_experts}")
    return dispatch("moe_sort_rows", experts.device, experts, weights, num_experts)


def moe_permute(
    x: torch.Tensor, experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of x for every (token, slot) pair, sorted by expert (stable: pairs of one expert in pair order).

    Args:
        x: [T, d] any dtype.
        experts: [T, k] integer expert ids in [0, num_experts) (not validated on the device).
        num_experts: E.

    Returns:
        x_sorted: [T * k, d], x_sorted[j] = x[order[j] // k];
        order: [T * k] int64, the pair id of each sorted row (routing weights of the sorted rows:
            ``weights.flatten()[order]``);
        expert_offsets: [E + 1] int64, expert e owns sorted rows [offsets[e], offsets[e + 1]).
    """
    if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0] or experts.is_floating_point():
        raise ValueError(f"moe_permute: x must be [T, d] and experts integer [T, k], got {tuple(x.shape)}, "
                         f"{experts.dtype}{tuple(experts.shape)}")  # fmt: skip
    if num_experts < 1:
        raise ValueError(f"moe_permute: num_experts must be positive, got {num_experts}")
    return dispatch("moe_permute", x.device, x, experts, num_experts)


def moe_unpermute(
    y: torch.Tensor,
    order: torch.Tensor | None,
    num_tokens: int,
    weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum over slots i = 0, 1, ..., k-1 (in that order) of weights[t, i] * y[pos(t * k + i)], in fp32.

    pos(p) is the sorted row of pair p (the inverse of ``order``; ``order`` None: the identity, for the
    pair-major rows of ``mxfp4_grouped_gemm_gather``). Each token adds its own k rows in slot order, so a
    token's result does not depend on the other tokens (batch-invariant), whatever the backend.

    Args:
        y: [T * k, d] floating point expert outputs in sorted (or pair) order.
        order: [T * k] integer, from ``moe_permute``, or None.
        num_tokens: T (k = y.shape[0] / T).
        weights: [T, k] floating point routing weights, or None (weights already applied).
        out_dtype: default y.dtype.
        inverse: pos itself ([T * k] integer, ``moe_sort_rows``' inverse) when the caller has it: the inverse of
            ``order`` is then not built again (not checked against ``order``, which must still be given).

    Returns:
        [T, d] in ``out_dtype``.
    """
    p = y.shape[0]
    if y.dim() != 2 or num_tokens < 1 or p % num_tokens:
        raise ValueError(f"moe_unpermute: y {tuple(y.shape)} must be [T * k, d] with T = num_tokens = {num_tokens}")
    if order is not None and (order.dim() != 1 or order.shape[0] != p or order.is_floating_point()):
        raise ValueError(f"moe_unpermute: order must be integer [{p}], got {order.dtype}{tuple(order.shape)}")
    if weights is not None and tuple(weights.shape) != (num_tokens, p // num_tokens):
        raise ValueError(f"moe_unpermute: weights {tuple(weights.shape)} != ({num_tokens}, {p // num_tokens})")
    if inverse is not None and (order is None or inverse.shape != order.shape or inverse.is_floating_point()):
        raise ValueError(f"moe_unpermute: inverse must be integer [{p}] and comes with order, got "
                         f"{inverse.dtype}{tuple(inverse.shape)}")  # fmt: skip
    out_dtype = y.dtype if out_dtype is None else out_dtype
    return dispatch("moe_unpermute", y.device, y, order, num_tokens, weights, out_dtype, inverse=inverse)


try:  # GPU backends register themselves when Triton imports
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

__all__ = ["moe_permute", "moe_sort", "moe_sort_rows", "moe_unpermute"]

"""Expert-parallel MoE: dispatch (token, expert) pairs to the ranks holding the experts, run them, combine.

Per MoE layer, every EP rank calls (a collective over ``group``)::

    handle = ep_dispatch(x, experts, weights, placement, group)      # [T, d], [T, k] logical ids, [T, k] fp32
    y = expert_fn(handle.recv_x, handle.recv_slot, handle.recv_weight)   # local experts, per received pair
    routed = ep_combine(y, handle)                                   # [T, d] in x.dtype
    out = routed + shared_expert(x)                                  # the shared expert never leaves the rank

or ``ep_moe(...)`` for the three at once.

**Replica choice.** Pair (t, i) with logical expert e goes to replica ``(t + rank) % logcnt[e]`` of e (slots in
``placement.log2phy`` order): deterministic and spreading a hot expert's tokens over its replicas round-robin.

**Wire format.** ``all_to_all_single`` with variable splits; counts are exchanged first. A token goes to a rank
once however many of its k experts live there (rows are deduplicated per destination rank, like DeepEP); pair
metadata (row, local slot, weight bits) travels as int64. Payloads travel as raw bytes (uint8 views), so any dtype
(bf16, FP8) crosses gloo and NCCL unchanged.

**Combine and exactness.** ``combine="exact"`` (default) sends back one fp32 row per pair; the source adds a
token's k rows in ascending expert id (then slot) order starting from zero, in fp32, and casts once: the order of
``deepinfer_kernels.ops.moe.moe_experts``'s reference. With a row-invariant ``expert_fn`` (the CPU references are)
the result is **bitwise equal** to the single-process ``moe_experts`` whatever the world size and placement.
``combine="reduced"`` has the owner rank sum its pairs of a token first and send one row per (token, rank) in
``combine_dtype`` (DeepEP-like traffic: k/ranks-hit times less); the sum order then differs (not bitwise).

An optional DeepEP path (``deep_ep_adapter.py``) is chosen at run time when ``import deep_ep`` works on CUDA; it
is tested only against a fake of DeepEP's ``Buffer`` API.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepinfer_kernels.ops.moe import moe_experts

from ._comm import all_to_all_rows
from .placement import ExpertPlacement

ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [N, d], local_slot [N] int64 in [0, S), weight [N] fp32) -> [N, d] fp32: the weighted output of each pair's
expert (routing weight applied before the down projection, as the reference)."""


def swiglu_expert_fn(w13_local: torch.Tensor, w2_local: torch.Tensor, *, swiglu_limit: float | None) -> ExpertFn:
    """The routed SwiGLU experts of this rank's slots, via the ``moe_experts`` op with k = 1 on fp32 input.

    Args:
        w13_local: [S, 2I, d]; w2_local: [S, d, I]: the weights of this rank's physical slots in local order
            (``w13[placement.local_logical(rank)]``).
    """

    def run(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return moe_experts(x.float(), slot[:, None], weight[:, None], w13_local, w2_local, swiglu_limit=swiglu_limit)

    return run


@dataclass
class DispatchHandle:
    """What ``ep_dispatch`` hands to the local experts and keeps for ``ep_combine``.

    Attributes:
        recv_x: [R, d] x.dtype, tokens received (each once per source rank, grouped by source rank).
        recv_slot: [N] int64, local physical slot of each received pair.
        recv_weight: [N] fp32, its routing weight.
        recv_row: [N] int64, its row in ``recv_x``.
        (the rest: bookkeeping for the combine)
    """

    recv_x: torch.Tensor
    recv_slot: torch.Tensor
    recv_weight: torch.Tensor
    recv_row: torch.Tensor
    num_tokens: int
    top_k: int
    dtype: torch.dtype
    send_tok: torch.Tensor  # [R_send] token of each sent row (x's device, as every tensor here)
    send_pairs: list[int]
    recv_pairs: list[int]
    send_rows: list[int]
    recv_rows: list[int]
    combine_index: torch.Tensor  # [T, k] row of the returned pairs for token t's j-th expert (ascending id)
    group: dist.ProcessGroup | None


def choose_replicas(experts: torch.Tensor, placement: ExpertPlacement, rank: int) -> torch.Tensor:
    """[T, k] physical slot of each pair: replica ``(t + rank) % logcnt[e]`` of its logical expert e (on
    ``experts``' device; ids must be valid)."""
    log2phy, logcnt = placement.tables_on(experts.device)
    experts = experts.long()
    t = torch.arange(experts.shape[0], device=experts.device)[:, None]
    replica = (t + rank) % logcnt[experts]
    return log2phy[experts, replica]


def ep_dispatch(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    placement: ExpertPlacement,
    group: dist.ProcessGroup | None = None,
) -> DispatchHandle:
    """Send every (token, expert) pair to the rank holding its chosen replica (collective over ``group``).

    The layout (replicas, destination ranks, row and pair order) is computed on ``x``'s device; the host waits
    once per dispatch, for the split sizes the all-to-alls need (``.tolist()`` after the counts exchange).

    Args:
        x: [T, d] tokens of this rank (any dtype; T may be 0). CPU for gloo, CUDA for nccl.
        experts: [T, k] int logical expert ids (the router's output).
        weights: [T, k] routing weights (sent as fp32).
        placement: the layer's ``ExpertPlacement``; ``placement.num_ranks`` must equal the group size.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if placement.num_ranks != world:
        raise ValueError(f"ep_dispatch: placement is for {placement.num_ranks} ranks, group has {world}")
    if x.dim() != 2 or experts.dim() != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(
            f"ep_dispatch: need x [T, d], experts [T, k], weights [T, k]; got {tuple(x.shape)}, "
            f"{tuple(experts.shape)}, {tuple(weights.shape)}"
        )
    dev = x.device
    num_tokens, top_k = experts.shape
    ids = experts.to(dev).long()
    bad = ((ids < 0) | (ids >= placement.num_logical)).any()
    ids = ids.clamp(0, placement.num_logical - 1)  # reported after the host sync below; never index with a bad id
    phys = choose_replicas(ids, placement, rank).reshape(-1)  # [T*k]
    dst = phys // placement.slots_per_rank
    local_slot = phys % placement.slots_per_rank

    # rows: each token once per destination rank, ascending token within a rank block
    hit = torch.zeros(num_tokens, world, dtype=torch.bool, device=dev)
    tok_of_pair = torch.arange(num_tokens * top_k, device=dev) // top_k
    hit[tok_of_pair, dst] = True
    row_in_block = torch.cumsum(hit.long(), 0) - 1  # [T, W]
    # pairs: rank-major, then (token, slot)
    order = torch.sort(dst, stable=True).indices
    meta = torch.stack(
        [
            row_in_block[tok_of_pair, dst][order],
            local_slot[order],
            weights.to(dev).reshape(-1).float().view(torch.int32).long()[order],
        ],
        dim=1,
    )
    pairs_per_rank = torch.zeros(world, dtype=torch.int64, device=dev).scatter_add_(0, dst, torch.ones_like(dst))
    counts = torch.stack([hit.sum(0), pairs_per_rank], dim=1)  # [W, 2] rows, pairs to each rank
    recv_counts = all_to_all_rows(counts, [1] * world, [1] * world, group)
    host = torch.cat([counts.reshape(-1), recv_counts.reshape(-1), bad.reshape(1).long()]).tolist()  # the sync
    if host[-1]:
        raise ValueError(f"ep_dispatch: expert ids must be in [0, {placement.num_logical})")
    send_rows, send_pairs = host[0 : 2 * world : 2], host[1 : 2 * world : 2]
    recv_rows, recv_pairs = host[2 * world : 4 * world : 2], host[2 * world + 1 : 4 * world : 2]

    # hit rows rank-major, then token: a stable sort puts the (rank, token) entries that are set first, in order
    first_set = torch.sort((~hit.t().reshape(-1)).to(torch.uint8), stable=True).indices
    send_tok = first_set[: sum(send_rows)] % max(num_tokens, 1)
    recv_x = all_to_all_rows(x[send_tok], send_rows, recv_rows, group)
    recv_meta = all_to_all_rows(meta, send_pairs, recv_pairs, group)
    row_offset = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
    src_of_pair = torch.repeat_interleave(
        torch.arange(world, device=dev), recv_counts[:, 1], output_size=sum(recv_pairs)
    )
    recv_row = recv_meta[:, 0] + row_offset[src_of_pair]
    recv_weight = recv_meta[:, 2].to(torch.int32).view(torch.float32)

    # where the exact combine finds pair (t, j-th expert of t in ascending id order) among the returned rows
    sorted_cols = torch.sort(ids, dim=1, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=dev)
    combine_index = position[torch.arange(num_tokens, device=dev)[:, None] * top_k + sorted_cols]
    return DispatchHandle(
        recv_x=recv_x,
        recv_slot=recv_meta[:, 1],
        recv_weight=recv_weight,
        recv_row=recv_row,
        num_tokens=num_tokens,
        top_k=top_k,
        dtype=x.dtype,
        send_tok=send_tok,
        send_pairs=send_pairs,
        recv_pairs=recv_pairs,
        send_rows=send_rows,
        recv_rows=recv_rows,
        combine_index=combine_index,
        group=group,
    )


def ep_combine(
    y: torch.Tensor, handle: DispatchHandle, *, combine: str = "exact", combine_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Return the experts' outputs to their tokens and add them (collective over ``handle.group``).

    Args:
        y: [N, d] fp32, ``expert_fn``'s output for the received pairs (``handle.recv_*`` order).
        combine: "exact" (per-pair fp32 rows back; reference summation order) or "reduced" (per-(token, rank) rows
            in ``combine_dtype``, default the token dtype).

    Returns:
        [T, d] in the dtype of the dispatched x: sum over the token's k experts of their weighted outputs.
    """
    group, dev = handle.group, y.device
    d = y.shape[1]
    t, k = handle.num_tokens, handle.top_k
    if y.shape[0] != handle.recv_slot.shape[0]:
        raise ValueError(f"ep_combine: y has {y.shape[0]} rows, {handle.recv_slot.shape[0]} pairs were received")
    if combine == "exact":
        back = all_to_all_rows(y.float(), handle.recv_pairs, handle.send_pairs, group)  # [T*k, d] in send order
        ordered = back[handle.combine_index.reshape(-1)].view(t, k, d)  # per token, ascending expert
        out = torch.zeros((t, d), dtype=torch.float32, device=dev)
        for j in range(k):  # the reference's order: one add per token per expert, starting from zero
            out += ordered[:, j]
        return out.to(handle.dtype)
    if combine == "reduced":
        wire_dtype = combine_dtype or handle.dtype
        rows = torch.zeros((handle.recv_x.shape[0], d), dtype=torch.float32, device=dev)
        rows.index_add_(0, handle.recv_row, y.float())
        back = all_to_all_rows(rows.to(wire_dtype), handle.recv_rows, handle.send_rows, group)
        out = torch.zeros((t, d), dtype=torch.float32, device=dev)
        out.index_add_(0, handle.send_tok, back.float())
        return out.to(handle.dtype)
    raise ValueError(f"ep_combine: combine must be 'exact' or 'reduced', got {combine!r}")


def ep_moe(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    placement: ExpertPlacement,
    expert_fn: ExpertFn,
    group: dist.ProcessGroup | None = None,
    *,
    shared_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    combine: str = "exact",
) -> torch.Tensor:
    """Routed experts over EP (+ the local shared expert): ``ep_combine(expert_fn(ep_dispatch(...)))
    [+ shared_fn(x)]``, [T, d] in x.dtype. Equals ``moe_experts(x, experts, weights, w13, w2) [+ swiglu_mlp(x, ...)]``
    bitwise in exact mode with the reference experts."""
    handle = ep_dispatch(x, experts, weights, placement, group)
    y = expert_fn(handle.recv_x[handle.recv_row], handle.recv_slot, handle.recv_weight)
    out = ep_combine(y, handle, combine=combine)
    return out + shared_fn(x) if shared_fn is not None else out

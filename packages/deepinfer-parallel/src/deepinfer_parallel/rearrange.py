"""Moving expert weights from one placement to another (the EPLB rearrangement), without restarting.

``plan_moves(old, new)`` lists, for every physical slot whose logical expert changes, where its new weights come
from: a slot of the old placement holding that expert, preferably on the destination rank itself (a local copy),
otherwise on the rank that has sent the fewest weights so far (spreads the traffic; ties to the lowest slot).
``apply_moves`` is the single-process definition; ``exchange_expert_weights`` does it over a process group with
point-to-point sends. Reads always come from the *old* buffers, so the moves can be applied in any order.

Live rearrangement (how the engine calls this): between two engine steps, for one MoE layer at a time, every EP
rank calls ``exchange_expert_weights`` on that layer's local weights and swaps in the returned tensors and the new
``ExpertPlacement``; the other layers keep serving with the old placement meanwhile (each layer's placement is
independent), so the engine never drains its requests. Peak extra memory: one layer's local weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import ExpertPlacement


@dataclass(frozen=True)
class ExpertMove:
    """Copy the weights of ``logical`` from old slot ``src_slot`` (on ``src_rank``) into new slot ``dst_slot``
    (on ``dst_rank``). ``src_rank == dst_rank`` is a local copy."""

    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int
    logical: int


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[ExpertMove]:
    """The copies that turn ``old``'s physical slots into ``new``'s. Slots that keep their expert are not listed.

    Both placements must have the same P, E and ranks. Returns moves sorted by destination slot.
    """
    if (old.num_physical, old.num_logical, old.num_ranks) != (new.num_physical, new.num_logical, new.num_ranks):
        raise ValueError("plan_moves: placements differ in physical slots, logical experts or ranks")
    sends = [0] * old.num_ranks
    moves = []
    old_p2l, new_p2l = old.phy2log.tolist(), new.phy2log.tolist()
    for slot, expert in enumerate(new_p2l):
        if old_p2l[slot] == expert:
            continue
        dst_rank = slot // new.slots_per_rank
        sources = [s for s in old.log2phy[expert].tolist() if s >= 0]
        local = [s for s in sources if s // old.slots_per_rank == dst_rank]
        if local:
            src = local[0]
        else:
            src = min(sources, key=lambda s: (sends[s // old.slots_per_rank], s))
            sends[src // old.slots_per_rank] += 1
        moves.append(ExpertMove(src // old.slots_per_rank, src, dst_rank, slot, expert))
    return moves


def apply_moves(weights: Mapping[int, torch.Tensor], moves: Sequence[ExpertMove]) -> dict[int, torch.Tensor]:
    """Single-process definition: ``weights`` maps physical slot -> that slot's tensor under the old placement;
    returns the same under the new placement (unchanged slots keep their tensor object)."""
    new = dict(weights)
    for m in moves:
        new[m.dst_slot] = weights[m.src_slot]
    return new


def exchange_expert_weights(
    local: Sequence[torch.Tensor],
    moves: Sequence[ExpertMove],
    slots_per_rank: int,
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """Apply ``moves`` to this rank's expert weights over ``group`` (a collective: every rank calls it with the same
    moves; EP rank r = group rank r). Point-to-point only: with NCCL, run it on a group that has already done a
    collective (the EP group after its first all-to-all), since ranks without moves post nothing.

    Args:
        local: this rank's weights under the old placement, one tensor per kind (e.g. ``w13`` [S, 2I, d], ``w2``
            [S, d, I], FP8 scales ...), each [S, ...] with S = slots_per_rank on dim 0; CPU (gloo) or CUDA (nccl).
        moves: ``plan_moves(old, new)``.
        slots_per_rank: S.

    Returns:
        New tensors (same shapes, dtypes, devices) holding the new placement's local slots. ``local`` is unchanged.
    """
    rank = dist.get_rank(group)
    out = [t.clone() for t in local]
    ops = []
    recv_bufs = []
    for i, m in enumerate(moves):
        src_local, dst_local = m.src_slot - m.src_rank * slots_per_rank, m.dst_slot - m.dst_rank * slots_per_rank
        if m.src_rank == rank and m.dst_rank == rank:
            for t_out, t_in in zip(out, local):
                t_out[dst_local].copy_(t_in[src_local])
        elif m.src_rank == rank:
            peer = dist.get_global_rank(group, m.dst_rank) if group is not None else m.dst_rank
            for k, t_in in enumerate(local):
                ops.append(dist.P2POp(dist.isend, t_in[src_local].contiguous(), peer, group, tag=i * len(local) + k))
        elif m.dst_rank == rank:
            peer = dist.get_global_rank(group, m.src_rank) if group is not None else m.src_rank
            for k, t_out in enumerate(out):
                buf = torch.empty_like(t_out[dst_local])
                recv_bufs.append((k, dst_local, buf))
                ops.append(dist.P2POp(dist.irecv, buf, peer, group, tag=i * len(local) + k))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for k, dst_local, buf in recv_bufs:
        out[k][dst_local].copy_(buf)
    return out

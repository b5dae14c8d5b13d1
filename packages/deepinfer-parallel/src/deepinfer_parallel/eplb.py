"""Expert-parallel load balancer (EPLB): plan redundant experts and their placement from per-expert loads.

Written from the description of DeepSeek's published algorithm (deepseek-ai/EPLB, README and ``eplb.py`` at
``d52c72d``); the code here is our own. Three greedy steps:

1. ``balanced_packing``: put n weighted items into m packs of exactly n/m items each: visit items heaviest first
   and drop each into the lightest pack that still has room.
2. ``replicate_experts``: start with one replica per logical expert; each redundant slot goes to the expert whose
   per-replica load (load / replicas) is currently the largest.
3. Pack the replicas (weight = load / replicas) onto ranks with ``balanced_packing``.

Two policies (``rebalance_experts`` picks as upstream does):

- *hierarchical* when the experts come in groups and ``num_groups % num_nodes == 0``: pack whole expert groups onto
  nodes (so group-limited routing keeps a token's experts on few nodes), replicate within each node, then pack the
  node's replicas onto its ranks. Meant for prefill with a smaller EP.
- *global* otherwise (DeepSeek V4 / V4.1 have ``n_group = null``): the same with one group and one node, i.e.
  replicate globally and pack onto ranks (upstream's global policy since 2025-03-21 balances per GPU this way).

Everything runs on the CPU in a few milliseconds per layer (E = 256); results are deterministic (stable sorts, ties
to the lowest index).
"""

from __future__ import annotations

import torch

from .placement import ExpertPlacement

__all__ = [
    "ExpertPlacement",
    "balanced_packing",
    "rebalance_experts",
    "rebalance_layers",
    "replicate_experts",
]


def balanced_packing(weights: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n items into ``num_packs`` packs of exactly n / num_packs items, balancing the pack sums.

    Args:
        weights: [n] item weights (any real dtype); n must be a multiple of num_packs.
        num_packs: m >= 1.

    Returns:
        (pack [n] int64, rank_in_pack [n] int64): item i goes to pack ``pack[i]`` at position ``rank_in_pack[i]``
        (positions fill 0, 1, ... in the order items are placed, heaviest first).
    """
    weights = torch.as_tensor(weights).double().cpu()
    n = weights.numel()
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_packing: {n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    pack = torch.empty(n, dtype=torch.int64)
    rank_in_pack = torch.empty(n, dtype=torch.int64)
    load = [0.0] * num_packs
    count = [0] * num_packs
    for item in torch.argsort(weights, descending=True, stable=True).tolist():
        best = min((p for p in range(num_packs) if count[p] < per_pack), key=lambda p: load[p])
        pack[item] = best
        rank_in_pack[item] = count[best]
        load[best] += float(weights[item])
        count[best] += 1
    return pack, rank_in_pack


def replicate_experts(weights: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``num_physical - n`` redundant replicas to the experts with the largest per-replica load, one at a time.

    Args:
        weights: [n] logical expert loads.
        num_physical: total replicas, >= n.

    Returns:
        (phy2log [num_physical] int64: replica j's expert (the first n are experts 0..n-1, then the redundant ones
        in the order they were added), replica_idx [num_physical] int64: j's index among its expert's replicas,
        logcnt [n] int64: replicas per expert).
    """
    weights = torch.as_tensor(weights).double().cpu()
    n = weights.numel()
    if num_physical < n:
        raise ValueError(f"replicate_experts: {num_physical} physical slots < {n} logical experts")
    phy2log = torch.cat([torch.arange(n), torch.empty(num_physical - n, dtype=torch.int64)])
    replica_idx = torch.zeros(num_physical, dtype=torch.int64)
    logcnt = torch.ones(n, dtype=torch.int64)
    for j in range(n, num_physical):
        heaviest = int(torch.argmax(weights / logcnt))  # first index on ties
        phy2log[j] = heaviest
        replica_idx[j] = logcnt[heaviest]
        logcnt[heaviest] += 1
    return phy2log, replica_idx, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


def _rebalance_hierarchical(
    load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> torch.Tensor:
    """phy2log [num_physical] of the hierarchical policy (groups -> nodes, replicate per node, replicas -> ranks)."""
    num_logical = load.numel()
    if num_logical % num_groups or num_groups % num_nodes or num_ranks % num_nodes or num_physical % num_ranks:
        raise ValueError(
            f"EPLB: need E % groups == 0, groups % nodes == 0, ranks % nodes == 0 and P % ranks == 0; got "
            f"E={num_logical} groups={num_groups} nodes={num_nodes} ranks={num_ranks} P={num_physical}"
        )
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    phy_per_node = num_physical // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_rank = num_physical // num_ranks
    if phy_per_node < experts_per_node:
        raise ValueError(f"EPLB: {phy_per_node} slots per node cannot hold its {experts_per_node} experts")

    # 1. groups -> nodes; "node order" lists node 0's experts (its groups in packing order), then node 1's, ...
    group_pack, group_pos = balanced_packing(load.view(num_groups, group_size).sum(-1), num_nodes)
    group_slot = group_pack * groups_per_node + group_pos  # [G] position of each group in node order
    log2ord = (group_slot[:, None] * group_size + torch.arange(group_size)).flatten()
    ord2log = _inverse(log2ord)

    phy2log = torch.empty(num_physical, dtype=torch.int64)
    for node in range(num_nodes):
        experts = ord2log[node * experts_per_node : (node + 1) * experts_per_node]  # logical ids on this node
        node_load = load[experts]
        # 2. replicate inside the node
        rep2local, _, cnt = replicate_experts(node_load, phy_per_node)
        # 3. pack the node's replicas onto its ranks, by per-replica load
        rank, pos = balanced_packing(node_load[rep2local] / cnt[rep2local], ranks_per_node)
        slot_in_node = rank * slots_per_rank + pos
        node_phy = torch.empty(phy_per_node, dtype=torch.int64)
        node_phy[slot_in_node] = experts[rep2local]
        phy2log[node * phy_per_node : (node + 1) * phy_per_node] = node_phy
    return phy2log


def rebalance_experts(
    load: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    *,
    num_groups: int | None = None,
    num_nodes: int = 1,
) -> ExpertPlacement:
    """Plan one MoE layer's replicas and placement from its per-expert load.

    Args:
        load: [E] per-expert load (token counts over the recording window; any real dtype).
        num_physical: P = E + redundant experts; a multiple of num_ranks.
        num_ranks: EP ranks (GPUs); ``num_nodes`` of them per... i.e. ranks are split evenly over nodes, node-major.
        num_groups: expert groups of group-limited routing (None or 1: no groups -> global policy).
        num_nodes: nodes; the hierarchical policy is used when num_groups % num_nodes == 0.

    Returns:
        An ``ExpertPlacement`` (every logical expert has >= 1 replica).
    """
    load = torch.as_tensor(load).double().cpu()
    if load.dim() != 1:
        raise ValueError(f"rebalance_experts: load must be [E], got {tuple(load.shape)}")
    if num_groups is not None and num_groups > 1 and num_groups % num_nodes == 0:
        phy2log = _rebalance_hierarchical(load, num_physical, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _rebalance_hierarchical(load, num_physical, 1, 1, num_ranks)  # global policy
    return ExpertPlacement(phy2log, load.numel(), num_ranks)


def rebalance_layers(
    load: torch.Tensor, num_physical: int, num_ranks: int, *, num_groups: int | None = None, num_nodes: int = 1
) -> list[ExpertPlacement]:
    """``rebalance_experts`` for every layer of a [L, E] load (a ``LoadRecorder.load()``)."""
    if load.dim() != 2:
        raise ValueError(f"rebalance_layers: load must be [L, E], got {tuple(load.shape)}")
    return [rebalance_experts(row, num_physical, num_ranks, num_groups=num_groups, num_nodes=num_nodes) for row in load]

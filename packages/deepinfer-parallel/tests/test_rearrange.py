"""Weight-move plans: applied to per-slot tensors they give the new placement's tensors, locally and over gloo."""

import parallel_workers as W
import pytest
import torch
from deepinfer_parallel import ExpertPlacement, apply_moves, plan_moves, rebalance_experts


@pytest.mark.parametrize("seed", range(4))
def test_apply_moves_gives_new_placement(seed):
    g = torch.Generator().manual_seed(seed)
    num_experts, ranks, physical = 24, 4, 32
    logical = {e: torch.randn(3, 5, generator=g) for e in range(num_experts)}
    old = rebalance_experts(torch.rand(num_experts, generator=g) ** 3, physical, ranks)
    new = rebalance_experts(torch.rand(num_experts, generator=g) ** 3, physical, ranks)
    weights = {s: logical[int(e)] for s, e in enumerate(old.phy2log.tolist())}
    moves = plan_moves(old, new)
    got = apply_moves(weights, moves)
    for s, e in enumerate(new.phy2log.tolist()):
        assert torch.equal(got[s], logical[e])
    changed = int((old.phy2log != new.phy2log).sum())
    assert len(moves) == changed > 0
    for m in moves:
        assert int(old.phy2log[m.src_slot]) == m.logical == int(new.phy2log[m.dst_slot])
        assert m.src_rank == m.src_slot // old.slots_per_rank and m.dst_rank == m.dst_slot // new.slots_per_rank


def test_plan_prefers_local_copy():
    old = ExpertPlacement(torch.tensor([0, 1, 2, 3, 0, 2]), 4, 2)  # rank 0: 0 1 2, rank 1: 3 0 2
    new = ExpertPlacement(torch.tensor([0, 1, 0, 3, 1, 2]), 4, 2)  # slot 2 <- 0 (local), slot 4 <- 1 (remote)
    moves = plan_moves(old, new)
    assert [(m.src_rank, m.src_slot, m.dst_rank, m.dst_slot, m.logical) for m in moves] == [
        (0, 0, 0, 2, 0),
        (0, 1, 1, 4, 1),
    ]
    assert plan_moves(old, old) == []


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_expert_weights_over_gloo(world, ranks):
    outs = ranks(world, W.weight_exchange, 20, 4)
    remote = 0
    for got, expected, r in outs:
        remote = r
        for a, b in zip(got, expected):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert remote > 0

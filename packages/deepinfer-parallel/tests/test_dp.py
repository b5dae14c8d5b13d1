"""Attention-DP request balancing by tokens in flight."""

import random

import pytest
from deepinfer_parallel import DPBalancer, assign_requests


def test_assign_to_least_loaded_in_arrival_order():
    assert assign_requests([100, 10, 10, 200], [0, 0]) == [0, 1, 1, 1]
    assert assign_requests([5], [30, 10, 10]) == [1]  # ties -> lowest rank
    assert assign_requests([], [1, 2]) == []
    with pytest.raises(ValueError):
        assign_requests([1], [])


def test_balance_bound_on_random_traffic():
    rng = random.Random(0)
    tokens = [rng.choice([50, 200, 1000, 8000, 32000]) for _ in range(500)]
    ranks = assign_requests(tokens, [0] * 4)
    load = [0] * 4
    for t, r in zip(tokens, ranks):
        load[r] += t
    # greedy list scheduling: the spread is at most the largest request
    assert max(load) - min(load) <= max(tokens)
    naive = [sum(t for i, t in enumerate(tokens) if i % 4 == r) for r in range(4)]
    print(f"\nDP tokens per rank: round-robin {naive} -> balanced {load}")
    assert max(load) <= max(naive)


def test_balancer_tracks_finish():
    b = DPBalancer(2)
    assert b.add("a", 1000) == 0
    assert b.add("b", 10) == 1
    assert b.add("c", 10) == 1
    b.finish("a")
    assert b.inflight == [0, 20]
    assert b.add("d", 5) == 0 and b.rank_of("d") == 0
    with pytest.raises(ValueError):
        b.add("d", 1)


def test_balancer_restricted_to_allowed_ranks():
    b = DPBalancer(4)
    b.add("a", 100)  # rank 0
    assert b.add("b", 10, allowed=[2, 3]) == 2  # least loaded among the allowed, not rank 1
    assert b.add("c", 10, allowed=[3, 2]) == 3
    assert b.inflight == [100, 0, 10, 10]
    with pytest.raises(ValueError):
        b.add("d", 1, allowed=[])
    with pytest.raises(ValueError):
        b.add("e", 1, allowed=[4])

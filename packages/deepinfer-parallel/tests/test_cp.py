"""Balanced (zigzag) context parallelism: assignment, attention-work balance, gather round trip over gloo."""

import functools

import parallel_workers as W
import pytest
import torch
from deepinfer_parallel.cp import (
    balanced_assignment,
    causal_work,
    contiguous_assignment,
    imbalance,
    rank_work,
    sparse_work,
    window_halo,
    zigzag_assignment,
)


@pytest.mark.parametrize("seq_len,world,align", [(64, 2, 1), (1000, 4, 1), (4096, 4, 128), (300, 4, 128), (5, 4, 1)])
def test_assignment_partitions_sequence(seq_len, world, align):
    a = zigzag_assignment(seq_len, world, align=align)
    allpos = torch.cat([a.positions(r) for r in range(world)])
    assert sorted(allpos.tolist()) == list(range(seq_len))
    for r in range(world):
        for start, stop in a.ranges[r]:
            assert start % align == 0 and (stop % align == 0 or stop == seq_len)


def test_zigzag_pairs_mirror_chunks():
    a = zigzag_assignment(16, 2)
    assert a.ranges == (((0, 4), (12, 16)), ((4, 8), (8, 12)))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_causal_work_is_balanced(world):
    seq = 32768
    zz = imbalance(rank_work(zigzag_assignment(seq, world)))
    naive = imbalance(rank_work(contiguous_assignment(seq, world)))
    print(f"\nCP causal S={seq} W={world}: max/mean contiguous {naive:.3f} -> zigzag {zz:.5f}")
    assert zz < 1.0001
    assert naive > 1.3


@pytest.mark.parametrize(
    "window,ratio,top_k,zigzag_bound",
    [(128, 128, None, 1.005), (128, 4, 512, 1.06), (128, 4, None, 1.005)],
)
def test_sparse_work_is_balanced(window, ratio, top_k, zigzag_bound):
    seq, world = 16384, 4
    work = functools.partial(sparse_work, window=window, ratio=ratio, top_k=top_k)
    zz = imbalance(rank_work(zigzag_assignment(seq, world, align=128), work))
    naive = imbalance(rank_work(contiguous_assignment(seq, world), work))
    bal = imbalance(rank_work(balanced_assignment(seq, world, work, align=16), work))
    print(
        f"\nCP sparse S={seq} W={world} window={window} ratio={ratio} top_k={top_k}: max/mean contiguous {naive:.3f}"
        f" -> zigzag {zz:.4f} -> cost-balanced zigzag (align 16) {bal:.4f}"
    )
    assert zz <= zigzag_bound and zz <= naive
    assert bal <= 1.01


def test_balanced_assignment_partitions_and_handles_causal():
    for seq, world, align in [(1000, 4, 1), (4096, 2, 128), (7, 4, 1), (0, 2, 1)]:
        a = balanced_assignment(seq, world, align=align)
        allpos = torch.cat([a.positions(r) for r in range(world)])
        assert sorted(allpos.tolist()) == list(range(seq))
    assert imbalance(rank_work(balanced_assignment(32768, 4))) < 1.001


def test_sparse_work_formula():
    p = torch.tensor([0, 3, 4, 127, 200, 5000])
    got = sparse_work(p, window=128, ratio=4, top_k=512).tolist()
    assert got == [1 + 0, 4 + 1, 5 + 1, 128 + 32, 128 + 50, 128 + 512]
    assert causal_work(p).tolist() == [1, 4, 5, 128, 201, 5001]


def test_window_halo():
    a = zigzag_assignment(64, 2)  # rank 0: [0,16) + [48,64); rank 1: [16,32) + [32,48)
    assert window_halo(a, 0, 8) == [(41, 48)]
    assert window_halo(a, 1, 8) == [(9, 16)]  # [25, 32) is its own
    assert window_halo(a, 0, 1) == []


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seq_len,align", [(1000, 1), (515, 128)])
def test_gather_round_trip(world, seq_len, align, ranks):
    outs = ranks(world, W.cp_round_trip, seq_len, align, torch.bfloat16)
    sizes = [n for _, _, n in outs]
    assert sum(sizes) == seq_len
    for full, gathered, _ in outs:
        assert gathered.dtype == torch.bfloat16 and torch.equal(gathered, full)

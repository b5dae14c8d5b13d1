"""moe_permute / moe_unpermute: sorting (token, slot) pairs by expert and the fixed-order weighted scatter back.

(a) references against loops written here; (b) the Triton unpermute, the Triton counting sort (``moe_sort``) and
the grouped GEMMs' tile list (``grouped_tiles.expert_tile_schedule``) under TRITON_INTERPRET=1 (child process);
(c) GPU: Triton vs reference at V4.1-Flash sizes (hidden 5120, top-6 of 384) and bitwise invariance of a token's
result to the other tokens in the call; the sort (also with the sorted rows' tokens, weights and the inverse order
that ``moe_sort_rows_triton`` writes) and the tile list bitwise equal to their references at decode
sizes (V4 / V4.1: 256 experts, top-6), skewed routing and the radix-sort fallback past SORT_MAX_PAIRS included.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.ops.moe_permute import moe_permute, moe_sort_rows, moe_unpermute
from deepinfer_kernels.registry import reference
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not importable")


def _case(t, e, k, d, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(t, e, generator=g).argsort(1)[:, :k]
    x = torch.randn(t, d, generator=g)
    w = torch.rand(t, k, generator=g)
    return x.to(device), experts.to(device), w.to(device)


def test_permute_reference():
    t, e, k, d = 11, 7, 3, 5
    x, experts, _ = _case(t, e, k, d, seed=1)
    xs, order, offsets = moe_permute(x, experts, e)
    # independent: walk experts in order, pairs of each expert in pair order
    want_order = [p for ex in range(e) for p in range(t * k) if int(experts.flatten()[p]) == ex]
    assert order.tolist() == want_order
    counts = [sum(int(v) == ex for v in experts.flatten()) for ex in range(e)]
    assert offsets.tolist() == [sum(counts[:i]) for i in range(e + 1)]
    assert_bitwise(xs, torch.stack([x[p // k] for p in want_order]), "gathered rows")


def test_sort_rows_and_unpermute_with_inverse():
    """``moe_sort_rows`` is ``moe_permute``'s sort plus its torch expressions, and ``moe_unpermute`` given that
    inverse equals it without; bad arguments are named."""
    t, e, k, d = 13, 6, 3, 8
    x, experts, w = _case(t, e, k, d, seed=11)
    order, offsets, inverse, row_token, row_weight = moe_sort_rows(experts, w, e)
    xs, want_order, want_offsets = moe_permute(x, experts, e)
    assert_bitwise(order, want_order, "order")
    assert_bitwise(offsets, want_offsets, "offsets")
    assert_bitwise(x[row_token], xs, "rows of the sorted tokens")
    assert_bitwise(row_weight, w.flatten()[order], "sorted weights")
    assert_bitwise(inverse[order], torch.arange(t * k), "inverse")
    y = torch.randn(t * k, d)
    assert_bitwise(moe_unpermute(y, order, t, w, inverse=inverse), moe_unpermute(y, order, t, w), "unpermute")
    with pytest.raises(ValueError, match="weights"):
        moe_sort_rows(experts, w[:, :1], e)
    with pytest.raises(ValueError, match="inverse"):
        moe_unpermute(y, None, t, inverse=inverse)


def test_unpermute_reference():
    t, e, k, d = 9, 5, 2, 6
    x, experts, w = _case(t, e, k, d, seed=2)
    xs, order, _ = moe_permute(x, experts, e)
    y = xs * 3.0 - 1.0  # stand-in expert output per sorted row
    out = moe_unpermute(y, order, t, w)
    want = torch.zeros(t, d, dtype=torch.float64)
    for j, p in enumerate(order.tolist()):
        want[p // k] += w.flatten()[p].double() * y[j].double()
    assert_rel_close(out, want.float(), 1e-6, "weighted scatter")
    # identity order: pair-major rows
    assert_bitwise(moe_unpermute(y[torch.argsort(order)], None, t, w), out, "identity order")
    assert_rel_close(moe_unpermute(y, order, t), (3 * x - 1) * k, 1e-6, "no weights")


def _interp_unpermute(t: int, k: int, d: int) -> None:
    from deepinfer_kernels.ops.moe_permute import triton as backend

    x, experts, w = _case(t, 8, k, d, seed=3)
    xs, order, _ = moe_permute(x, experts, 8)
    for weights in (w, None):
        got = backend.moe_unpermute_triton(xs, order, t, weights, torch.float32)
        assert_rel_close(got, reference("moe_unpermute")(xs, order, t, weights, torch.float32), 1e-6, "unpermute")
        # order None (y pair-major: the kernel reads its rows in order) against the identity order spelled out
        ident = torch.arange(t * k)
        assert_bitwise(backend.moe_unpermute_triton(xs, None, t, weights, torch.float32),
                       backend.moe_unpermute_triton(xs, ident, t, weights, torch.float32), "order None")  # fmt: skip
    print("ok")


def _sort_cases(cases, device: str, seed: int) -> None:
    """moe_sort's Triton kernel and the tile list against the references (integers: bitwise), per (T, k, E, skew):
    skew routes every pair to the first few experts (long runs of one expert across chunks)."""
    from deepinfer_kernels.ops.grouped_tiles import (
        TileSpec,
        expert_tile_schedule,
        expert_tile_schedule_ref,
        expert_tile_schedules,
        tail_split,
    )
    from deepinfer_kernels.ops.moe_permute import triton as backend
    from deepinfer_kernels.ops.moe_permute.reference import inverse_order, moe_sort_ref

    for i, (t, k, e, skew) in enumerate(cases):
        _, experts, w = _case(t, e, k, 1, seed + i, device)
        if skew:
            experts = experts % 3
        order, offsets = backend.moe_sort_triton(experts, e)
        want_order, want_offsets = moe_sort_ref(experts, e)
        what = f"moe_sort T={t} k={k} E={e} skew={skew}"
        assert order.dtype == offsets.dtype == torch.int64, what
        assert_bitwise(order, want_order, what)
        assert_bitwise(offsets, want_offsets, what)
        # the sorted-layout MoE's sort: the same order and offsets plus the rows' tokens, weights and the inverse
        got = backend.moe_sort_rows_triton(experts, w, e)
        want = (want_order, want_offsets, inverse_order(want_order), want_order // k, w.flatten().float()[want_order])
        for name, a, b in zip(("order", "offsets", "inverse", "row token", "row weight"), got, want, strict=True):
            assert a.dtype == b.dtype, f"{name} {what}"
            assert_bitwise(a, b, f"{name} {what} (with rows)")
        for block_m, lo, hi in ((16, 0, None), (64, 0, None), (128, 0, None), (8, 0, 2), (64, 3, None), (8, 2, 5)):
            got = expert_tile_schedule(offsets, t * k, block_m, min_rows=lo, max_rows=hi)
            want = expert_tile_schedule_ref(offsets, t * k, block_m, min_rows=lo, max_rows=hi)
            assert got[3] == want[3], what
            for name, a, b in zip(("expert", "first row", "end row"), got[:3], want[:3]):
                assert_bitwise(a, b, f"tile {name} {what} BLOCK_M={block_m} rows [{lo}, {hi}]")
        tailed = (
            TileSpec(16, 0, None, 4),
            TileSpec(4, 0, None, 0, 16),
            TileSpec(8, 3, 40, 7),
            TileSpec(7, 3, 40, 0, 8),
        )
        for spec in tailed:
            got = expert_tile_schedule(offsets, t * k, *spec[:3], tail=spec.tail, tail_of=spec.tail_of)
            want = expert_tile_schedule_ref(offsets, t * k, *spec[:3], tail=spec.tail, tail_of=spec.tail_of)
            assert got[3] == want[3], what
            for name, a, b in zip(("expert", "first row", "end row"), got[:3], want[:3]):
                assert_bitwise(a, b, f"tile {name} {what} {spec}")
        # the MXFP4 split's lists, one launch: 8-row mma.sync, 32-row wgmma, 128-row TMA (and its tails)
        specs = [TileSpec(8, 0, 2), TileSpec(32, 3, 32), *tail_split(TileSpec(16, 33), 8)]
        for n in (2, 3, 4):
            for spec, got in zip(specs[:n], expert_tile_schedules(offsets, t * k, specs[:n]), strict=True):
                want = expert_tile_schedule_ref(offsets, t * k, *spec[:3], tail=spec.tail, tail_of=spec.tail_of)
                assert got[3] == want[3], what
                for name, a, b in zip(("expert", "first row", "end row"), got[:3], want[:3]):
                    assert_bitwise(a, b, f"tile {name} {what} {spec} of {n} lists")
    print("ok")


def _covered(schedule, block_m):
    """(row, expert) pairs of a tile list's tiles."""
    tile_e, r0, r1, _ = schedule
    return [(r, e) for e, a, b in zip(tile_e.tolist(), r0.tolist(), r1.tolist()) if e >= 0
            for r in range(a, min(a + block_m, b))]  # fmt: skip


def _top6_offsets(t, e, skew, seed):
    """(rows per expert, expert offsets) of T tokens' random top-6 routing over E experts (skew: over the first 30)."""
    _, experts, _ = _case(t, e, 6, 1, seed=seed)
    if skew:
        experts = experts % 30
    counts = torch.bincount(experts.flatten(), minlength=e)
    offsets = torch.zeros(e + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return counts, offsets


@pytest.mark.parametrize("limit", [0, 2, 16])
def test_tile_lists_split_by_row_count(limit):
    """Two tile lists with complementary row-count bounds (the MXFP4 Gluon / Triton split) cover every row once,
    each in its own expert's tile, and stay within their slot counts."""
    from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule_ref

    for t, e, skew in ((1, 256, False), (64, 384, False), (256, 384, True), (0, 8, False)):
        counts, offsets = _top6_offsets(t, e, skew, seed=t + limit)
        small = expert_tile_schedule_ref(offsets, t * 6, 8, max_rows=limit)
        big = expert_tile_schedule_ref(offsets, t * 6, 64, min_rows=limit + 1)
        rows = sorted(_covered(small, 8) + _covered(big, 64))
        owner = torch.repeat_interleave(torch.arange(e), counts).tolist()
        assert rows == list(enumerate(owner)), f"T={t} E={e} skew={skew} limit={limit}"
        assert all(counts[x] <= limit for _, x in _covered(small, 8))
        assert all(counts[x] > limit for _, x in _covered(big, 64))
        assert small[3] <= min(e, t * 6) * -(-limit // 8), "a bounded list has at most ceil(max / BLOCK_M) an expert"


@pytest.mark.parametrize("block_m, tail", [(128, 32), (16, 4), (8, 7)])
def test_tail_split_covers_the_body_rows_once(block_m, tail):
    """``tail_split``: the body list and its tail list cover together exactly the rows of the list without the
    split, each in its own expert's tile; the tail tiles are those of the experts with 1 .. tail rows past a full
    tile, each holding exactly those rows."""
    from deepinfer_kernels.ops.grouped_tiles import TileSpec, expert_tile_schedule_ref, tail_split

    for t, e, skew in ((1, 256, False), (64, 384, False), (256, 384, True), (700, 16, False), (0, 8, False)):
        counts, offsets = _top6_offsets(t, e, skew, seed=t + block_m)
        plain = TileSpec(block_m, 3)
        body, tails = tail_split(plain, tail)
        lists = [
            expert_tile_schedule_ref(offsets, t * 6, *s[:3], tail=s.tail, tail_of=s.tail_of)
            for s in (plain, body, tails)
        ]
        what = f"T={t} E={e} skew={skew} BLOCK_M={block_m} tail={tail}"
        split = sorted(_covered(lists[1], block_m) + _covered(lists[2], tail))
        assert split == sorted(_covered(lists[0], block_m)), what
        want = [x for x in range(e) if counts[x] > block_m and 0 < counts[x] % block_m <= tail]
        tail_e, r0, r1, _ = lists[2]
        assert sorted(x for x in tail_e.tolist() if x >= 0) == want, what
        assert all(0 < b - a <= tail for x, a, b in zip(tail_e.tolist(), r0.tolist(), r1.tolist()) if x >= 0), what
    with pytest.raises(ValueError, match="tail_rows"):
        tail_split(TileSpec(16), 16)


SORT_CASES = [(1, 6, 256, False), (40, 6, 16, False), (30, 6, 8, True), (3, 2, 5, False), (0, 6, 8, False)]
test_unpermute_and_sort_triton_interpreted = needs_triton(
    interpreted_cases_test(
        __file__,
        {"unpermute": ("_interp_unpermute", (5, 3, 1100)), "sort": ("_sort_cases", (SORT_CASES, "cpu", 1))},
    )
)


@pytest.mark.gpu
def test_gpu_sort_and_tile_list():
    from deepinfer_kernels.ops.moe_permute import triton as backend
    from deepinfer_kernels.registry import resolve

    cases = [(t, 6, 256, False) for t in (1, 8, 22, 64, 256, 682)] + [(256, 6, 256, True), (64, 6, 384, False)]
    cases.append((backend.SORT_MAX_PAIRS // 6 + 1, 6, 256, False))  # past SORT_MAX_PAIRS: the reference
    _sort_cases(cases, "cuda", 7)
    assert resolve("moe_sort", "cuda") is backend.moe_sort_triton


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_gpu_unpermute(t):
    from deepinfer_kernels.ops.moe_permute import triton as backend

    x, experts, w = _case(t, 384, 6, 5120, seed=t, device="cuda")
    xs, order, _ = moe_permute(x.to(torch.bfloat16), experts, 384)
    got = backend.moe_unpermute_triton(xs, order, t, w)
    assert_rel_close(got, reference("moe_unpermute")(xs, order, t, w, torch.float32), 1e-2, "bf16 out")
    if t >= 64:  # token 0 alone == token 0 among t (bitwise)
        xs1, order1, _ = moe_permute(x[:1].to(torch.bfloat16), experts[:1], 384)
        assert_bitwise(backend.moe_unpermute_triton(xs1, order1, 1, w[:1]), got[:1], "token 0 alone")

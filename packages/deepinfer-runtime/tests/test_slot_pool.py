"""The slot pool of the fixed-size cache kinds: rings by position, slot claims and copies, and the accounting
(the bytes a slot holds are what the KV budget reserves per request and per prefix snapshot)."""

from functools import partial

import pytest
import torch
from deepinfer_runtime import slot_pool
from deepinfer_runtime.models.deepseek_v4 import v4_cache_layout
from deepinfer_runtime.models.deepseek_v4_cache import v4_slot_specs
from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
from deepinfer_runtime.models.deepseek_v41 import v41_cache_layout, v41_slot_specs
from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config
from deepinfer_runtime.slot_pool import Ring, SlotPool, SlotSpec, append_window
from deepinfer_runtime.testing.tiny_checkpoint import tiny_v4_config, tiny_v41_config


def _rows(lo, hi, width=3):
    return torch.arange(lo, hi, dtype=torch.float32)[:, None].expand(-1, width).clone()


def test_ring_keeps_the_last_rows_by_position_and_rolls_back():
    ring = Ring(torch.zeros(5, 3))
    ring.write(0, _rows(0, 3))
    ring.write(3, _rows(3, 11))  # longer than the ring: only positions 6..10 survive
    assert (ring.lo, ring.end) == (6, 11)
    assert torch.equal(ring.view(), _rows(6, 11))
    assert torch.equal(ring.read(8, 10), _rows(8, 10))
    ring.rollback(2)  # the rows of 9, 10 are forgotten; 6..8 were never overwritten
    assert torch.equal(ring.view(), _rows(6, 9))
    ring.write(9, _rows(9, 10) + 100)
    assert torch.equal(ring.view(), torch.cat([_rows(6, 9), _rows(9, 10) + 100]))
    with pytest.raises(RuntimeError, match="outside the held"):
        ring.read(4, 8)
    with pytest.raises(RuntimeError, match="behind its end"):
        ring.write(3, _rows(3, 4))
    ring.write(20, _rows(20, 22))  # a gap: the older rows are no longer contiguous with the new ones
    assert (ring.lo, ring.end) == (20, 22)


@pytest.mark.parametrize("held", [0, 2, 6])
def test_append_window_returns_the_held_rows_before_the_chunk(held):
    window = 4  # a query sees itself and the 3 positions before it
    ring = Ring(torch.zeros(window - 1 + 2, 3))
    if held:
        ring.write(0, _rows(0, held))
    rows, first = append_window(ring, _rows(held, held + 5), window, held)
    assert first == max(held - (window - 1), 0)
    assert torch.equal(rows, _rows(first, held + 5))
    assert torch.equal(ring.view(), _rows(held + 5 - ring.capacity, held + 5))


def test_slots_are_claimed_released_and_copied():
    specs = [SlotSpec("a", "kind a", 4, 2, torch.float32), SlotSpec("b", "kind b", 3, 1, torch.int64)]
    pool = SlotPool(specs, num_requests=2, num_snapshots=1, device="cpu")
    assert pool.bytes_per_slot == 4 * 2 * 4 + 3 * 8 == sum(s.nbytes for s in specs)
    r0, r1 = pool.claim(), pool.claim()
    with pytest.raises(RuntimeError, match="no free request slot"):
        pool.claim()
    r0["a"].write(0, torch.ones(3, 2))
    r0["b"].write(0, torch.tensor([[7]]))
    snap = r0.copy_to("snapshot")
    assert snap.slot not in (r0.slot, r1.slot)
    with pytest.raises(RuntimeError, match="no free snapshot slot"):
        pool.claim("snapshot")
    r0["a"].write(3, torch.full((2, 2), 5.0))  # the request moves on; the snapshot keeps its rows
    r0.release()
    r0.release()  # idempotent
    back = snap.copy_to("request")
    assert (back["a"].lo, back["a"].end) == (0, 3)
    assert torch.equal(back["a"].view(), torch.ones(3, 2)) and torch.equal(back["b"].view(), torch.tensor([[7]]))
    snap.release()
    assert pool.num_free("snapshot") == 1 and pool.num_free("request") == 0


@pytest.mark.parametrize("backtrack", [0, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_bytes_equal_the_budgeted_fixed_bytes(tiny_v4_dirs, backtrack, dtype):
    """What a pool slot allocates, kind by kind, is what ``cache_layout`` (and so ``CacheBudget``) reserves."""
    v4 = [DeepseekV4Config.from_file(path / "config.json") for path in tiny_v4_dirs.values()]
    with_mtp = partial(v4_slot_specs, mtp=True), partial(v4_cache_layout, mtp=True)  # V4's MTP drafting rings
    cases = [(cfg, v4_slot_specs, v4_cache_layout) for cfg in v4] + [(v4[0], *with_mtp)]
    v4_0731 = DeepseekV4Config.from_dict(tiny_v4_config(dspark_target_layer_ids=[2, 4], dspark_markov_rank=8))
    cases.append((v4_0731, partial(v4_slot_specs, dspark=True), partial(v4_cache_layout, dspark=True)))
    cases.append((DeepseekV41Config.from_dict(tiny_v41_config()), v41_slot_specs, v41_cache_layout))
    for cfg, specs_of, layout_of in cases:
        specs = specs_of(cfg, dtype, backtrack)
        pool = SlotPool(specs, 1, 1, "cpu")
        layout = layout_of(cfg, dtype, backtrack)
        assert pool.bytes_per_slot == layout.fixed_bytes
        allocated = {}
        for spec in specs:  # per kind, from the tensors the pool really holds
            allocated[spec.kind] = allocated.get(spec.kind, 0) + pool.buffers[spec.key][0].nbytes
        assert allocated == {k.name: k.fixed_bytes for k in layout.kinds if k.fixed_bytes}


def test_engine_pool_matches_its_budget_and_gets_every_slot_back(tiny_v4_dirs):
    from deepinfer_runtime import LLM, SamplingParams

    llm = LLM(
        model=tiny_v4_dirs["mixed"],
        dtype="float32",
        device="cpu",
        max_num_seqs=3,
        max_num_batched_tokens=32,
        block_size=16,
        enable_prefix_caching=True,
        log_stats=False,
    )
    slots = llm.engine.runner.slots
    assert (slots.num_requests, slots.num_snapshots) == (3, llm.budget.snapshot_slots)
    assert (slots.num_requests + slots.num_snapshots) * slots.bytes_per_slot == llm.budget.fixed_total
    shared = list(range(100, 140))
    prompts = [shared + [7 + i] * (3 + i) for i in range(5)]  # more requests than request slots
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert slots.num_free("request") == 3  # finished requests gave theirs back
    held = len(llm.prefix_cache.snapshots)
    assert held > 0 and slots.num_free("snapshot") == slots.num_snapshots - held


@pytest.mark.parametrize("loop_rings", [0, 512])  # tensor operations; Python ints
def test_step_rings_moves_every_ring_as_advance_would(loop_rings, monkeypatch):
    """A decode step's plan moves the rings of every request and key at once (``SlotPool.step_rings``): each ends
    where ``Ring.advance(p, 1)`` puts it and each group's first held position is ``Ring.first_held``'s, on random
    bounds (held, restarted, empty rings); keys whose rings hold other positions or have another capacity come back
    in groups of their own, and a write behind a ring's end is refused before anything moves."""
    monkeypatch.setattr(slot_pool, "LOOP_RINGS", loop_rings)
    gen = torch.Generator().manual_seed(0)
    specs = [SlotSpec(k, "x", 6, 1, torch.float32) for k in "abc"] + [SlotSpec("d", "x", 9, 1, torch.float32)]
    pool, twin = SlotPool(specs, 5, 0, "cpu"), SlotPool(specs, 5, 0, "cpu")
    slots, twins = [pool.claim() for _ in range(5)], [twin.claim() for _ in range(5)]
    starts = []
    for s, t in zip(slots, twins):
        end = int(torch.randint(0, 20, (1,), generator=gen))
        lo = max(end - int(torch.randint(0, 7, (1,), generator=gen)), 0)
        p = end + int(torch.randint(0, 2, (1,), generator=gen)) * 3  # at the end, or past it (a restart)
        starts.append(p)
        for k in "abcd":
            shift = 1 if k == "c" and len(starts) == 2 else 0  # c differs for one request only
            for ring in (s[k], t[k]):
                ring.lo, ring.end = lo + shift, end + shift
    order = torch.randperm(5, generator=gen).tolist()  # a batch's requests in any slot order
    rows = [slots[i].slot for i in order]
    batch_starts = torch.tensor([starts[i] for i in order])
    groups = pool.step_rings(list("abcd"), torch.tensor(rows), batch_starts, 3)
    assert sorted(sorted(keys) for keys, _ in groups) == [["a", "b"], ["c"], ["d"]]
    for keys, firsts in groups:
        for k in keys:
            expect = [twins[i][k].first_held(starts[i], 3) for i in order]
            assert firsts == expect, k
    for i in order:
        for k in "abcd":
            twins[i][k].advance(starts[i], 1)
            assert (slots[i][k].lo, slots[i][k].end) == (twins[i][k].lo, twins[i][k].end), (i, k)
    slots[order[0]]["c"].end += 5  # the next step writes behind c's end: a, b and d, planned first, stay
    before = pool.bounds.clone()
    with pytest.raises(RuntimeError, match="ring c: write at position .* behind its end"):
        pool.step_rings(list("abcd"), torch.tensor(rows), batch_starts + 1, 3)
    assert torch.equal(pool.bounds, before)


def test_ring_moves_into_another_slot_with_its_rows_and_bounds():
    pool = SlotPool([SlotSpec("w", "x", 4, 3, torch.float32)], 2, 0, "cpu")
    a, b = pool.claim(), pool.claim()
    ring = a["w"]
    ring.write(0, _rows(0, 6))
    ring.move_into(b["w"])
    assert (b["w"].lo, b["w"].end) == (2, 6) and torch.equal(b["w"].view(), _rows(2, 6))
    ring.write(6, _rows(6, 7))  # the moved ring now writes b's slot and bounds
    assert b["w"].end == 7 and torch.equal(pool.buffers["w"][b.slot, 6 % 4], _rows(6, 7)[0])
    assert torch.equal(pool.bounds[b.slot, 0], torch.tensor([3, 7]))

"""Prefix caching: the allocator's reference counts and LRU, the block keys, and end to end that a hit
changes nothing: greedy tokens and their logprobs are bitwise those of the engine without the cache."""

import random

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.engine.kv_cache import BlockAllocator
from deepinfer_runtime.engine.prefix_cache import chain_hashes
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("prefix") / "v41", "v4.1", "fp8+fp4", seed=3)


def test_chain_hashes_name_the_whole_prefix():
    a = list(range(100))
    b = a[:40] + [7] + a[41:]
    ka, kb = chain_hashes(a, 16), chain_hashes(b, 16)
    assert len(ka) == 6 and ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))
    assert chain_hashes(a, 16, ka[:3]) == ka  # incremental = from scratch
    assert chain_hashes(a[16:32] + a[:16], 16)[1] != ka[1]  # same block tokens, different history


def test_allocator_refcounts_and_lru_under_random_operations():
    rng = random.Random(0)
    alloc = BlockAllocator(12, 4)
    evicted = []
    alloc.on_evict = lambda b, h: evicted.append(h)
    holders: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and alloc.can_grow([], 8):
            held: list[int] = []
            alloc.grow(held, rng.randint(1, 8))
            for b in held:
                if rng.random() < 0.5:
                    alloc.hashed[b] = f"k{step}-{b}".encode()
            holders.append(held)
        elif op < 0.6 and alloc.hashed:
            cached = [b for b in alloc.hashed if alloc.ref[b] == 0]
            if cached:  # a prefix hit on an evictable block
                b = rng.choice(cached)
                alloc.acquire(b)
                holders.append([b])
        elif holders:
            alloc.release(holders.pop(rng.randrange(len(holders))))
        alloc.check()
    assert evicted, "the LRU list should have been drawn on"


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 129000, (70,), generator=g).tolist()
    other = torch.randint(3, 129000, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 129000, (n,), generator=g).tolist() for n in (1, 9, 20, 33, 50)]
    prompts += [system[:40], system, system + other, other + system, prompts[2], prompts[3][:60]]
    return prompts


def _llm(path, prefix: bool, **kw):
    opts = dict(dtype="float32", device="cpu", max_num_seqs=5, max_num_batched_tokens=32, log_stats=False)
    opts.update(kw)
    return LLM(model=path, enable_prefix_caching=prefix, **opts)


def _run(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    outs = []
    for half in (prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]):  # the second half finds a warm cache
        outs += llm.generate(half, sp, use_tqdm=False)
    return outs


def _same(outs_on, outs_off):
    for on, off in zip(outs_on, outs_off):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids, f"prompt of {len(on.prompt_token_ids)} tokens"
        assert on.outputs[0].cumulative_logprob == off.outputs[0].cumulative_logprob  # bitwise, not approx


@pytest.mark.parametrize("mode", ["off", "compact"])
def test_v41_prefix_hits_change_nothing(v41_dir, mode):
    prompts = _shared_prefix_prompts(0)
    kw = dict(yoco_mode=mode, yoco_keep_tokens=24)
    on = _llm(v41_dir, True, **kw)
    outs_on = _run(on, prompts)
    outs_off = _run(_llm(v41_dir, False, **kw), prompts)
    _same(outs_on, outs_off)
    cached = [o.num_cached_tokens for o in outs_on]
    assert sum(cached) > 0 and all(c % on.engine.scheduler.blocks.block_size == 0 for c in cached)
    replay = 24 if mode == "compact" else 1
    assert all(c <= len(o.prompt_token_ids) - replay for c, o in zip(cached, outs_on))
    assert on.prefix_cache.stats.hit_tokens == sum(cached)
    on.engine.scheduler.blocks.check()


def test_v4_prefix_hits_change_nothing(tiny_v4_dirs):
    prompts = _shared_prefix_prompts(1)
    outs_on = _run(_llm(tiny_v4_dirs["mixed"], True), prompts)
    outs_off = _run(_llm(tiny_v4_dirs["mixed"], False), prompts)
    _same(outs_on, outs_off)
    assert sum(o.num_cached_tokens for o in outs_on) > 0


def test_hits_under_memory_pressure_evict_and_stay_exact(v41_dir):
    # 5 slots + 5 snapshots of fixed state and 8 blocks of 16 tokens: cached blocks must be evicted constantly
    budget = 10 * 127_000 + 128 * 1536
    prompts = _shared_prefix_prompts(2)
    on = _llm(v41_dir, True, yoco_mode="off", kv_cache_memory=budget)
    assert on.budget.num_tokens == 128
    outs_on = _run(on, prompts)
    _same(outs_on, _run(_llm(v41_dir, False, yoco_mode="off", kv_cache_memory=budget), prompts))
    on.engine.scheduler.blocks.check()


def test_block_size_must_hold_whole_groups(tiny_v4_dirs):
    with pytest.raises(ValueError, match="block_size must be a multiple"):
        _llm(tiny_v4_dirs["mixed"], True, block_size=8)  # the tiny V4 has an HCA ratio of 16


def test_snapshots_only_where_every_computed_token_is_known():
    # async scheduling: a recomputed request can run its pending token (value still on the device); the state
    # after it must not be filed under the key of the last block whose tokens are known
    from deepinfer_runtime import SamplingParams
    from deepinfer_runtime.engine.prefix_cache import PrefixCache
    from deepinfer_runtime.engine.request import Request
    from deepinfer_runtime.engine.scheduler import Scheduler, SchedulerConfig

    alloc = BlockAllocator(8, 4)
    prefix = PrefixCache(alloc, max_snapshots=4, replay=1)
    sched = Scheduler(SchedulerConfig(), alloc, prefix)
    req = Request("r", None, list(range(3, 10)), SamplingParams(), seed=0)  # 7 known tokens
    req.num_pending, req.prefill_len = 1, 8
    alloc.grow(req.block_ids, 8)
    sched.computed(req, 8, lambda: "state after 8 tokens")
    assert len(prefix.by_key) == 1 and not prefix.snapshots  # block 0 is cached, but no snapshot at 4 or 8
    req.num_pending = 0
    req.output_token_ids.append(11)
    req.num_computed_tokens = 4
    sched.computed(req, 4, lambda: "state after 8 tokens")
    assert list(prefix.snapshots.values()) == ["state after 8 tokens"] and len(prefix.by_key) == 2

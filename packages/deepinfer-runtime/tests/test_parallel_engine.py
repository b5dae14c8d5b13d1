"""Multi-process engine (issue 8) on the CPU with gloo: attention DP + expert parallel, CP long prefills, live
EPLB and rank failure. Every equality is against the single-process engine on the same tiny checkpoint, greedy,
token for token. Spawned ranks make these the slowest engine tests: tiny models, few tokens."""

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from deepinfer_parallel import ParallelError
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

# short prompts (DP), and two prompts over the CP threshold of 50 tokens
LENGTHS = [5, 17, 80, 1, 40, 64, 9]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
OPTS = dict(dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, log_stats=False)


def _prompts(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 129000, (n,), generator=g).tolist() for n in lengths]


@contextmanager
def _one_thread():
    # the reference runs while spawned ranks may still exit: oversubscribed OpenMP threads crawl on small hosts
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _mixed_params(prompts):
    """Greedy, plus seeded sampling (n = 2): the sampler is seeded per request, so no rank placement may matter."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True, n=2)
    return [GREEDY if i % 2 else sampled for i in range(len(prompts))]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _single(path, prompts, params=GREEDY, **kw):
    with _one_thread():
        return _tokens(LLM(model=path, **{**OPTS, **kw}).generate(prompts, params, use_tqdm=False))


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("par") / "v41", "v4.1", "fp8+fp4", seed=4)


def test_world2_v4_dp_ep_cp_with_live_eplb_equals_single_process(tiny_v4_dirs):
    path = tiny_v4_dirs["mixed"]
    prompts = _prompts()
    params = _mixed_params(prompts)
    # 8 request slots per rank: every CP job's owner has a free one (a full owner falls back to ordinary prefill)
    opts = {**OPTS, "max_num_seqs": 8}
    ref = _single(path, prompts, params, **opts)
    llm = LLM(
        model=path,
        data_parallel_size=2,
        context_parallel_size=2,
        context_parallel_min_tokens=50,
        enable_eplb=True,
        eplb_window_size=4,
        eplb_step_interval=2,
        num_redundant_experts=2,
        **opts,
    )
    try:
        outs = _tokens(llm.generate(prompts, params, use_tqdm=False))
        placements = llm.engine.placements()
    finally:
        llm.shutdown()
    assert outs == ref
    engine = llm.engine
    # each rank read only its 5 slots' experts (8 experts + 2 redundant: slot p holds expert p mod 8); EPLB
    # then moved weights between the ranks and outputs still equal the single process
    for stats, experts in zip(engine.load_stats, ({0, 1, 2, 3, 4}, {5, 6, 7, 0, 1}), strict=True):
        assert stats.routed_experts() == {("layers", layer): experts for layer in range(4)}
        assert stats.bytes_read < stats.checkpoint_bytes
    assert engine.cp_prefills == 3  # the 80-token prompt (n = 2: two requests) and the 64-token one; rest DP
    # EPLB rearranged live (requests in flight) and really moved experts
    assert engine.eplb_rearrangements >= 2 and engine.eplb_moved_slots > 0
    assert placements[0] == placements[1], "ranks disagree on the expert placement"
    default = [e % 8 for e in range(10)]  # 8 experts + 2 redundant slots before any rearrangement
    assert any(layer != default for layer in placements[0]), "no layer's placement changed"
    for layer in placements[0]:
        assert sorted(set(layer)) == list(range(8)), "every logical expert keeps a replica"


@pytest.mark.parametrize("world, yoco", [(2, "compact"), (4, "mask")])
def test_v41_dp_ep_cp_equals_single_process(world, yoco, v41_dir):
    # keep 22 = window 16 + 6: the 80- and 64-token prompts truncate (floor > 0) in their CP prefill
    kw = dict(yoco_mode=yoco, yoco_keep_tokens=22)
    # world 4: three long prompts, so one step has a CP job in one CP group only (the other group joins the
    # collectives, EP and sharded Engram, with an empty pass)
    prompts = _prompts(seed=world, lengths=[5, 80, 1, 64, 17] + [70] * (world // 4))
    ref = _single(v41_dir, prompts, **kw)
    llm = LLM(
        model=v41_dir, data_parallel_size=world, context_parallel_size=2, context_parallel_min_tokens=50, **OPTS, **kw
    )
    try:
        outs = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    assert outs == ref
    assert llm.engine.cp_prefills == 2 + world // 4
    # per-rank loading: 16 experts split into `world` consecutive blocks, the DSpark stages' experts everywhere;
    # the Engram rows read by all ranks together are each table exactly once
    stats = llm.engine.load_stats
    per = 16 // world
    for rank, st in enumerate(stats):
        read = st.routed_experts()
        assert {read[k] == set(range(rank * per, (rank + 1) * per)) for k in read if k[0] == "layers"} == {True}
        assert {frozenset(read[k]) for k in read if k[0] == "mtp"} == {frozenset(range(8))}
    table = _whole_engram_bytes(v41_dir)
    assert sum(st.bytes_of(contains=".engram.embed.") for st in stats) == table
    assert all(st.bytes_of(contains=".engram.embed.") < table for st in stats)


def _whole_engram_bytes(path):
    from safetensors import safe_open

    total = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as fh:
            total += sum(fh.get_tensor(n).nbytes for n in fh.keys() if ".engram.embed." in n)
    return total


def test_killed_rank_ends_the_engine_with_a_clear_error(tiny_v4_dirs):
    llm = LLM(model=tiny_v4_dirs["mixed"], data_parallel_size=2, **OPTS)
    engine = llm.engine
    pids = engine.group.pids

    def kill_after_first_steps():
        deadline = time.monotonic() + 60
        while engine.num_steps < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_steps, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(ParallelError, match=r"rank 1 died with exit code -9 \(SIGKILL\)"):
        llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 60
    killer.join()
    assert engine.group.closed
    for pid in pids:  # reaped, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ParallelError):  # the engine stays down
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(data_parallel_size=2, expert_parallel_size=3), "expert_parallel_size must be 1 or equal"),
        (dict(data_parallel_size=2, context_parallel_size=4), "context_parallel_size .4. must divide"),
        (dict(data_parallel_size=2, expert_parallel_size=1, enable_eplb=True), "enable_eplb needs expert"),
        (dict(data_parallel_size=0), "data_parallel_size must be a positive int"),
        (dict(data_parallel_size=2, eplb_step_interval=5), "enable_eplb is False"),
        (dict(data_parallel_size=2, context_parallel_size=2, context_parallel_min_tokens=1), ">= 2"),
    ],
)
def test_bad_parallel_arguments_are_refused_before_spawning(kw, message, tiny_v4_dirs):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_v4_dirs["mixed"], **OPTS, **kw)


def test_redundant_slots_must_split_over_ranks(tiny_v4_dirs):
    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        LLM(model=tiny_v4_dirs["mixed"], data_parallel_size=2, num_redundant_experts=1, **OPTS)


def test_idle_rank_runs_its_experts_with_the_layer_clamp(tiny_v4_dirs):
    # a rank with nothing to run still computes the tokens other ranks route to its experts: with expert weights
    # scaled so that the SwiGLU clamp (swiglu_limit 10) bites, that work must use the layer's clamp
    from deepinfer_parallel import WorkerGroup
    from deepinfer_runtime.model_loader import load_model
    from deepinfer_runtime.testing.parallel_workers import ep_forward_one_busy_rank, scale_routed_experts

    path, factor = tiny_v4_dirs["mixed"], 300.0
    prompt = _prompts(seed=5, lengths=[12])[0]
    with _one_thread():
        model = load_model(path, dtype=torch.float32, device="cpu", progress=False)
        scale_routed_experts(model, factor)
        ref = model.forward_logits(torch.tensor([prompt]))[0]
        for block in model.layers:
            block.ffn.limit = None
        assert not torch.equal(model.forward_logits(torch.tensor([prompt]))[0], ref), "the clamp does not bite"
    with WorkerGroup(2, backend="gloo", call_timeout_s=120) as group:
        outs = group.call(ep_forward_one_busy_rank, str(path), prompt, factor, 0)
    assert outs[1] is None and torch.equal(outs[0], ref)


def test_ep_layers_through_a_fake_deep_ep_buffer(tiny_v4_dirs):
    # the engine's DeepEP plumbing (EPExperts -> deep_ep_moe -> DeepEPDispatcher -> Buffer) against a fake of
    # DeepEP's Buffer API; real deep_ep is not installed here. bf16 (what DeepEP takes), reduced combine: close
    from deepinfer_parallel import WorkerGroup
    from deepinfer_runtime.model_loader import load_model
    from deepinfer_runtime.testing.parallel_workers import ep_forward_fake_deep_ep

    path = tiny_v4_dirs["mixed"]
    prompt = _prompts(seed=9, lengths=[12])[0]
    with _one_thread():
        ref = load_model(path, dtype=torch.bfloat16, device="cpu", progress=False).forward_logits(
            torch.tensor([prompt])
        )[0]
    with WorkerGroup(2, backend="gloo", call_timeout_s=120) as group:
        outs = group.call(ep_forward_fake_deep_ep, str(path), prompt)
    for logits, calls in outs:
        assert calls == {"get_dispatch_layout": 4, "dispatch": 4, "combine": 4}  # one per MoE layer
        torch.testing.assert_close(logits.float(), ref.float(), rtol=0.05, atol=0.1)  # wrong experts: ~5
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_cp_owner_without_free_blocks_falls_back_to_ordinary_prefill(tiny_v4_dirs):
    # 10 KV blocks of 16 tokens per rank. Step 1: the short prompt goes to rank 0, the first long one is CP-prefilled
    # for rank 1 (9 blocks). Step 2 (one CP job per group per step): the second long one's owner is rank 0, whose
    # short request holds 7 blocks: it cannot take 9, so the group skips and rank 0 prefills it the ordinary way.
    path = tiny_v4_dirs["mixed"]
    kw = dict(kv_cache_memory=8 * 28_672 + 160 * 136)  # 4 request slots + 4 snapshots fixed, 160 growing tokens
    prompts = _prompts(seed=7, lengths=[100, 130, 130])
    ref = _single(path, prompts, **kw)
    llm = LLM(model=path, data_parallel_size=2, context_parallel_size=2, context_parallel_min_tokens=120, **OPTS, **kw)
    try:
        assert llm.budget.num_tokens == 160
        outs = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    assert outs == ref
    assert (llm.engine.cp_prefills, llm.engine.cp_fallbacks) == (1, 1)


def test_ep_backend_comes_from_the_environment(monkeypatch):
    from deepinfer_runtime.distributed.config import ParallelConfig

    monkeypatch.delenv("DEEPINFER_EP_BACKEND", raising=False)
    assert ParallelConfig.create(2).ep_backend == "all_to_all"
    monkeypatch.setenv("DEEPINFER_EP_BACKEND", "deep_ep")
    assert ParallelConfig.create(2).ep_backend == "deep_ep"
    monkeypatch.setenv("DEEPINFER_EP_BACKEND", "nvshmem")
    with pytest.raises(ValueError, match="DEEPINFER_EP_BACKEND must be one of"):
        ParallelConfig.create(2)


def test_cp_owner_without_a_free_request_slot_falls_back_to_ordinary_prefill(tiny_v4_dirs):
    # the scenario of the first test with 4 request slots per rank (8 requests, 3 of them long): once the short
    # requests and a CP-prefilled one hold an owner's 4 slots, the later CP jobs fall back to ordinary prefill
    path = tiny_v4_dirs["mixed"]
    prompts = _prompts()
    params = _mixed_params(prompts)
    ref = _single(path, prompts, params)
    llm = LLM(model=path, data_parallel_size=2, context_parallel_size=2, context_parallel_min_tokens=50, **OPTS)
    try:
        outs = _tokens(llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.shutdown()
    assert outs == ref
    assert (llm.engine.cp_prefills, llm.engine.cp_fallbacks) == (1, 2)

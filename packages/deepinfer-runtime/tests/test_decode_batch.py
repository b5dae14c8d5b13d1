"""Planned decode steps (``decode_batch``): a decode step of requests in the engine's layout (one slot pool, paged
rows in one ``KVPools``) runs attention for all of them at once. Its logits are bitwise those of the per-request
path (requests in private pools, or with standalone rows), on the CPU in float32 and on CUDA in batch-invariant
mode, for V4 and V4.1, with requests of different lengths crossing CSA / HCA / ratio-2 group boundaries and at
group starts (first entries); V4.1's DSpark context and Engram lookback equal too. On CUDA, steps replayed from
whole-step CUDA graphs (padded batch buckets) give the same bits (V4 and V4.1). The launch-saving flags keep the
bits: V4's ``FUSED_POOL_ROWS`` (the top-k writing the attention row table) on the CPU through the op's reference and
through its Triton kernel in the interpreter, and on CUDA like the others."""

import os

import pytest
import torch
from deepinfer_kernels import registry
from deepinfer_kernels.registry import set_batch_invariant
from deepinfer_runtime import load_model
from deepinfer_runtime.cuda_graphs import StepGraphs
from deepinfer_runtime.decode_batch import DecodeBatch, batch_bucket
from deepinfer_runtime.kv_pool import KVPools, PagedRows
from deepinfer_runtime.models import deepseek_v4, deepseek_v41, layers
from deepinfer_runtime.slot_pool import Ring, SlotPool, SlotSpec
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

V4_CONFIG = {"compress_ratios": [4, 128, 0, 4], "num_hidden_layers": 4, "num_hash_layers": 1, "sliding_window": 8}
LENGTHS = [3, 17, 126, 9, 1, 40]  # the 126-token prompt completes an HCA group (128) during decode
STEPS = 10


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_batch")
    return {
        "v4": write_tiny_checkpoint(root / "v4", "v4", "none", seed=1, config=V4_CONFIG),
        "v4.1": write_tiny_checkpoint(root / "v41", "v4.1", "fp8+fp4", seed=0),
    }


def _decode(model, device, shared: bool, paged: bool, spy):
    """Prefill prompts of LENGTHS (one step, per-request path), then STEPS greedy decode steps; all logits."""
    n, blocks = len(LENGTHS), 16
    pool = SlotPool(model.slot_specs(), n, 0, device) if shared else None
    kv_pools = KVPools(n * blocks, 16, device)
    caches = [
        model.new_cache(
            new_rows=kv_pools.factory(list(range(i * blocks, (i + 1) * blocks))) if paged else None,
            slots=pool.claim() if shared else None,
        )
        for i in range(n)
    ]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (k,), generator=g).to(device) for k in LENGTHS]
    out = [torch.cat(model.forward_step(prompts, caches))]
    calls = spy.count
    tokens = [p[-1:] for p in prompts]
    for _ in range(STEPS):
        logits = model.forward_step(tokens, caches)
        out.append(torch.cat(logits))
        tokens = [row[-1:].argmax(-1) for row in logits]
    _decode.caches = caches  # for the state checks
    return out, spy.count - calls


class _Spy:
    """Counts the calls of a batched-decode method (so the test knows which path ran)."""

    def __init__(self, monkeypatch, owner, name):
        self.count, fn = 0, getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


SPIES = {"v4": (deepseek_v4.Attention, "decode"), "v4.1": (deepseek_v41.Attention, "forward_decode")}
OPTIONS = {"v4": {}, "v4.1": {"yoco_mode": "off"}}


def _check(arch, dirs, device, dtype, monkeypatch, graphs=False):
    model = load_model(dirs[arch], dtype=dtype, device=device, progress=False, **OPTIONS[arch])
    spy = _Spy(monkeypatch, *SPIES[arch])
    ref, calls = _decode(model, device, shared=False, paged=False, spy=spy)
    ref_caches = _decode.caches
    assert calls == 0  # requests in private pools: the per-request path
    _, calls = _decode(model, device, shared=True, paged=False, spy=spy)
    assert calls == 0  # standalone rows: the per-request path
    if graphs:
        model.enable_cuda_graphs(max_tokens=8)
    got, calls = _decode(model, device, shared=True, paged=True, spy=spy)
    assert calls == STEPS * len(model.layers)  # one batched call per layer and step (or per capture)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {step} differs by {(a - b).abs().max().item()}"
    for a, b in zip(ref_caches, _decode.caches):  # state the logits do not show yet: V4.1's DSpark context, lookback
        assert a.seq_len == b.seq_len and getattr(a, "ctx_end", 0) == getattr(b, "ctx_end", 0)
        for k, ring in getattr(a, "dspark_ctx", {}).items():
            assert torch.equal(ring.view(), b.dspark_ctx[k].view())
        if getattr(a, "engram_history", None) is not None:
            assert torch.equal(a.engram_history, b.engram_history)
    return model


@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_batched_decode_equals_per_request_cpu(arch, dirs, monkeypatch):
    _check(arch, dirs, "cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_batched_decode_equals_per_request_cuda(arch, dirs, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    set_batch_invariant(True)
    try:
        _check(arch, dirs, "cuda", torch.bfloat16, monkeypatch)
    finally:
        set_batch_invariant(None)


def test_v41_without_candidate_lane_cpu(dirs, monkeypatch):
    """``deepseek_v41.CANDIDATE_LANE`` off: the candidate blocks made on the index lane before the top-k give the
    same steps as with their own lane (the default; on the CPU the lanes run inline: this checks the path's
    bookkeeping, the GPU test below its streams)."""
    monkeypatch.setattr(deepseek_v41, "CANDIDATE_LANE", False)
    _check("v4.1", dirs, "cpu", torch.float32, monkeypatch)


def _toggle_keeps_the_bits(arch, dirs, monkeypatch, toggle, what: str) -> None:
    """Planned steps with ``toggle(m, True)`` (m: a monkeypatch), eagerly and replayed from whole-step graphs, equal
    the planned steps with ``toggle(m, False)``, bitwise (the tiny checkpoint in bf16 on CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = load_model(dirs[arch], dtype=torch.bfloat16, device="cuda", progress=False, **OPTIONS[arch])
    model.enable_cuda_graphs(max_tokens=8)

    def eager():
        with monkeypatch.context() as m:  # the same plans (padded, bucketed), every step run eagerly
            m.setattr(StepGraphs, "run", lambda self, key, fn, *inputs: fn(*inputs))
            return _decode(model, "cuda", shared=True, paged=True, spy=_Spy(m, *SPIES[arch]))[0]

    toggle(monkeypatch, False)
    without = eager()
    toggle(monkeypatch, True)
    with_it = eager()
    assert len(model.step_graphs) == 0
    graphed, _ = _decode(model, "cuda", shared=True, paged=True, spy=_Spy(monkeypatch, *SPIES[arch]))
    assert len(model.step_graphs) >= 1
    for step, (a, b, c) in enumerate(zip(without, with_it, graphed)):
        assert torch.equal(a, b), f"eager step {step}: {what} changes the logits by {(a - b).abs().max().item()}"
        assert torch.equal(a, c), f"graph step {step}: {what} changes the logits by {(a - c).abs().max().item()}"


@pytest.mark.gpu
def test_v41_candidate_lane_cuda(dirs, monkeypatch):
    """The candidate lane on a GPU: planned steps with it, eagerly and replayed from whole-step graphs (the lane forks
    from the index lane and rejoins the main path at the step's end), equal the planned steps without it, bitwise."""
    toggle = lambda m, on: m.setattr(deepseek_v41, "CANDIDATE_LANE", on)  # noqa: E731
    _toggle_keeps_the_bits("v4.1", dirs, monkeypatch, toggle, "the lane")


@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_fused_out_rope_cpu(arch, dirs, monkeypatch):
    """``layers.FUSED_OUT_ROPE`` off: the attention output's inverse RoPE as a launch of its own. (On, the default,
    the attention op makes it: on the CPU its reference rotates its output; the GPU test below checks the kernels.)"""
    monkeypatch.setattr(layers, "FUSED_OUT_ROPE", False)
    _check(arch, dirs, "cpu", torch.float32, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_fused_out_rope_cuda(arch, dirs, monkeypatch):
    """The inverse RoPE in the attention kernels' epilogue: planned steps with it, eagerly and replayed from
    whole-step graphs, equal the steps with the RoPE's own launch, bitwise."""
    toggle = lambda m, on: m.setattr(layers, "FUSED_OUT_ROPE", on)  # noqa: E731
    _toggle_keeps_the_bits(arch, dirs, monkeypatch, toggle, "the fusion")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_index_lane_first_cuda(arch, dirs, monkeypatch):
    """The index layers' q up-projection launched without programmatic dependent launch (``INDEX_LANE_FIRST``):
    planned steps, eagerly and replayed from whole-step graphs, equal the steps with it, bitwise."""
    module = deepseek_v4 if arch == "v4" else deepseek_v41
    toggle = lambda m, on: m.setattr(module, "INDEX_LANE_FIRST", on)  # noqa: E731
    _toggle_keeps_the_bits(arch, dirs, monkeypatch, toggle, "the launch order")


def _count_row_maps(monkeypatch) -> list[bool]:
    """Spies on V4's ``indexer_topk``: one entry a call, True where it got a row map (the fused path ran)."""
    calls, topk = [], deepseek_v4.indexer_topk

    def counted(*args, **kwargs):
        calls.append(kwargs.get("row_map") is not None)
        return topk(*args, **kwargs)

    monkeypatch.setattr(deepseek_v4, "indexer_topk", counted)
    return calls


def _csa_layers(model) -> int:
    return sum(hasattr(block.attn, "indexer") for block in model.layers)


def test_fused_pool_rows_cpu(dirs, monkeypatch):
    """``deepseek_v4.FUSED_POOL_ROWS`` on: the CSA layers' top-k makes the attention row table (``indexer_topk``'s
    ``row_map``) instead of ``DecodeBatch.pool_rows`` after it; the planned steps equal the per-request path, bitwise,
    as with it off. On the CPU the op runs its reference (the composition itself) and the lanes run inline: this
    checks the wiring (the map's tables, rows per block, offset and window prefix); the interpreted test below runs
    the Triton kernels inside the steps, and the GPU test the kernels on the streams."""
    monkeypatch.setattr(deepseek_v4, "FUSED_POOL_ROWS", True)
    mapped = _count_row_maps(monkeypatch)
    model = _check("v4", dirs, "cpu", torch.float32, monkeypatch)
    assert sum(mapped) == STEPS * _csa_layers(model) > 0, "one fused top-k per CSA layer and planned step"


def _interp_fused_pool_rows(path: str) -> None:
    """Under TRITON_INTERPRET=1 with ``indexer_topk`` pinned to its Triton backend (which then takes CPU tensors):
    the planned V4 steps with ``FUSED_POOL_ROWS`` on (the register kernel writes the row table) equal those with it
    off (the kernel's picks, then ``paged_rows``' reference), bitwise."""
    os.environ["DEEPINFER_BACKEND_INDEXER_TOPK"] = "triton"
    from deepinfer_kernels.ops.indexer.triton import indexer_topk_triton

    assert registry.resolve("indexer_topk", "cpu") is indexer_topk_triton
    model = load_model(path, dtype=torch.float32, device="cpu", progress=False)
    steps = {}
    with pytest.MonkeyPatch.context() as m:
        mapped = _count_row_maps(m)
        for on in (False, True):
            m.setattr(deepseek_v4, "FUSED_POOL_ROWS", on)
            steps[on] = _decode(model, "cpu", shared=True, paged=True, spy=_Spy(m, *SPIES["v4"]))[0]
    assert sum(mapped) == STEPS * _csa_layers(model) > 0
    for step, (a, b) in enumerate(zip(steps[False], steps[True])):
        assert torch.equal(a, b), f"step {step}: the fused row table changes the logits by {(a - b).abs().max()}"


def test_fused_pool_rows_interpreted(dirs):
    """The Triton top-k writing the row table inside V4's planned steps, on the CPU (``_interp_fused_pool_rows``, in a
    child process: the interpreter must be on before triton is imported)."""
    pytest.importorskip("triton")
    from deepinfer_kernels.testing.triton_interpreter import NUMPY_REFUSAL, NUMPY_SKIP, run_interpreted_cases

    error = run_interpreted_cases(__file__, {"v4": ("_interp_fused_pool_rows", (str(dirs["v4"]),))})["v4"]
    if NUMPY_REFUSAL in error:
        pytest.skip(NUMPY_SKIP)
    assert not error, error


@pytest.mark.gpu
def test_fused_pool_rows_cuda(dirs, monkeypatch):
    """The top-k writing the attention row table on the index lane (``FUSED_POOL_ROWS``; the window lane awaited
    before it): planned steps, eagerly and replayed from whole-step graphs, equal the steps with ``paged_rows``,
    bitwise."""
    toggle = lambda m, on: m.setattr(deepseek_v4, "FUSED_POOL_ROWS", on)  # noqa: E731
    _toggle_keeps_the_bits("v4", dirs, monkeypatch, toggle, "the fused row table")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v4", "v4.1"])
def test_step_graphs_give_the_eager_results(arch, dirs, monkeypatch):
    """Decode steps of 6 requests (batch bucket 8: two padding rows, tables rounded up to 8 blocks) replayed from
    whole-step CUDA graphs equal the same planned steps run eagerly, bitwise; V4.1 with its Engram tables in pinned
    host memory (the default on a GPU, read in place by the device) too, and with pageable host tables (read
    through the host) runs its planned steps eagerly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engram = {"engram_device": "cuda"} if arch == "v4.1" else {}  # V4.1: the tables on the device first
    model = load_model(dirs[arch], dtype=torch.bfloat16, device="cuda", progress=False, **OPTIONS[arch], **engram)
    model.enable_cuda_graphs(max_tokens=8)
    with monkeypatch.context() as m:  # the same plans (padded, bucketed), every step run eagerly
        m.setattr(StepGraphs, "run", lambda self, key, fn, *inputs: fn(*inputs))
        eager, _ = _decode(model, "cuda", shared=True, paged=True, spy=_Spy(m, *SPIES[arch]))
    assert len(model.step_graphs) == 0
    graphed, _ = _decode(model, "cuda", shared=True, paged=True, spy=_Spy(monkeypatch, *SPIES[arch]))
    assert len(model.step_graphs) >= 1 and batch_bucket(len(LENGTHS)) == 8
    for step, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"step {step} differs by {(a - b).abs().max().item()}"
    if arch == "v4.1":
        host = load_model(dirs[arch], dtype=torch.bfloat16, device="cuda", progress=False, **OPTIONS[arch])
        tables = [b.engram for b in host.layers if hasattr(b, "engram")]
        assert tables and all(e.rows.is_pinned() for e in tables)
        host.enable_cuda_graphs(max_tokens=8)
        pinned, _ = _decode(host, "cuda", shared=True, paged=True, spy=_Spy(monkeypatch, *SPIES[arch]))
        assert len(host.step_graphs) >= 1
        for step, (a, b) in enumerate(zip(eager, pinned)):  # the same gathered rows: the same bits
            assert torch.equal(a, b), f"pinned host tables: step {step} differs by {(a - b).abs().max().item()}"
        for e in tables:  # pageable copies: a lookup goes through the host, so steps cannot be captured
            e.set_table(e.rows.clone(), e.scale.clone() if e.scale is not None else None)
            assert not e.rows.is_pinned()
        with monkeypatch.context() as m:
            m.setattr(StepGraphs, "run", lambda *a: pytest.fail("a step with pageable Engram tables used graphs"))
            again, _ = _decode(host, "cuda", shared=True, paged=True, spy=_Spy(m, *SPIES[arch]))
        for a, b in zip(eager, again):  # other batch rows and table widths: equal up to bf16 rounding
            assert (a - b).abs().max() <= 2e-2 * a.abs().max()


class _Bucketed:
    """Stands in for ``StepGraphs`` on the CPU: the plan pads its rows to the batch bucket."""

    def applies(self, rows, device):
        return True


def test_plan_then_device_work():
    """The plan records from which position each ring holds the rows behind the new one (a ring restarted by a
    later write holds nothing before it) and advances the bounds like ``write``; after the step's ``write``,
    ``ring_ids`` addresses those rows and the new one in place; padding rows write only the scratch slot;
    ``plan_append`` sends the entries of requests completing a group to their table's rows, the others to the
    scratch row; ``pages`` addresses each request's rows through its table; a table too short is named."""
    pool = SlotPool([SlotSpec("r", "x", 4, 2, torch.float32)], 3, 0, "cpu")
    slots = [pool.claim() for _ in range(3)]
    rings = [s["r"] for s in slots]
    rings[0].write(0, torch.arange(12.0).view(6, 2))  # holds positions 2..5
    rings[1].write(0, torch.ones(2, 2))
    rings[1].advance(7, 0)  # restarted at 7: nothing before 7 is held
    kv_pools = KVPools(8, 4, "cpu")
    stores = [PagedRows(kv_pools, "k", 2, table) for table in ([3, 0], [5], [1, 6])]  # 2 rows per block
    for s, n in zip(stores, (3, 0, 1)):
        s.pool = kv_pools.get("k", 2, 3, torch.float32)
        s.resume(n)
    kv_pools.pools["k"].data.copy_(torch.arange(48.0).view(8, 2, 3))
    batch = DecodeBatch([6, 7, 0], [s.slot for s in slots], pool, graphs=_Bucketed())  # rows padded to 4
    batch.plan_ring(["r"], 3)
    batch.plan_append({"k": stores}, 2, {"k": 3}, torch.float32)
    batch.plan_tables([s.table for s in stores], 4, bucket=False)
    batch.seal(torch.device("cpu"))
    assert [(r.lo, r.end) for r in rings] == [(3, 7), (7, 8), (0, 1)]
    assert [len(s) for s in stores] == [3, 1, 1]  # positions 6 and 0 complete no ratio-2 group; 7 does
    assert batch.rows == batch_bucket(3) == 4 and batch.pad == 1

    new = torch.arange(-8.0, 0.0).view(4, 2)
    table = batch.write("r", new)
    ids = batch.ring_ids("r", 4)  # positions p - 3 .. p: the 3 rows behind, as planned, and the new one
    assert torch.equal(table[ids[0]], torch.cat([torch.arange(6.0, 12.0).view(3, 2), new[:1]]))
    assert (ids[1:, :3] == -1).all() and torch.equal(table[ids[1:, 3]], new[1:])  # nothing held behind
    assert torch.equal(rings[0].read(6, 7), new[:1]) and torch.equal(rings[2].read(0, 1), new[2:3])
    assert torch.equal(pool.buffers["r"][pool.scratch, 0], new[3])  # the padding row
    with pytest.raises(RuntimeError, match="needs 5 rows"):
        batch.ring_ids("r", 5)
    kv = kv_pools.pools["k"]
    batch.append("k", torch.full((4, 3), 7.0))
    assert (kv.data[5, 0] == 7).all() and (kv.flat[kv.scratch_row] == 7).all()
    data, tables = batch.pages("k")  # each request's rows through its table: [rows, 2 blocks x 2, 3]
    got = data[tables].view(4, -1, 3)
    assert data is kv.data and got.shape == (4, 4, 3)
    assert torch.equal(got[0, :3], torch.cat([kv.data[3], kv.data[0, :1]]))
    assert torch.equal(got[2, :1], kv.data[1, :1])
    batch2 = DecodeBatch([9], [slots[0].slot], pool)
    with pytest.raises(RuntimeError, match="needs block 2"):
        stores[0].resume(4)
        batch2.plan_append({"k": stores[:1]}, 2, {"k": 3}, torch.float32)
    with pytest.raises(RuntimeError):
        Ring(torch.zeros(2, 1)).advance(-1, 1)


def test_plan_groups_rings_and_appends_that_move_together():
    """Keys planned in one call share one field where their rings (their stores) hold the same positions (entries),
    and get exactly what planning each key alone gives; a key whose rings or stores differ is planned on its own,
    also exactly as alone."""
    specs = [SlotSpec(k, "x", 6, 1, torch.float32) for k in "abc"] + [SlotSpec("d", "x", 9, 1, torch.float32)]

    starts = [9, 9, 8]  # requests 0 and 1 complete a ratio-2 group, request 2 does not

    def setup():
        pool = SlotPool(specs, 3, 0, "cpu")
        slots = [pool.claim() for _ in range(3)]
        for s, p in zip(slots, starts):  # a, b and d hold positions up to p - 1 (a, b the last 6); c restarted
            for k in "abd":
                s[k].write(0, torch.zeros(p, 1))
            s["c"].write(0, torch.zeros(3, 1))
            s["c"].advance(p - 1, 1)
        kv_pools = KVPools(8, 4, "cpu")
        tables = [[3, 0, 4], [5, 6, 2], [1, 7, 0]]
        stores = {k: [PagedRows(kv_pools, k, 2, t) for t in tables] for k in ("x", "y", "z")}
        for k, lengths in (("x", (3, 4, 1)), ("y", (3, 4, 1)), ("z", (2, 4, 1))):  # z differs for request 0
            for s, n in zip(stores[k], lengths):
                s.pool = kv_pools.get(k, 2, 1, torch.float32)
                s.resume(n)
        return pool, slots, stores

    pool, slots, stores = setup()
    batch = DecodeBatch(starts, [s.slot for s in slots], pool)
    batch.plan_ring(list("abcd"), 3)
    batch.plan_append(stores, 2, dict.fromkeys(stores, 1), torch.float32)
    batch.seal(torch.device("cpu"))
    assert batch.layout[("first", "a")] == batch.layout[("first", "b")]  # one field
    assert len({batch.layout[("first", k)] for k in "acd"}) == 3  # c (other bounds), d (other capacity): alone
    assert batch.layout[("emit", "x")] == batch.layout[("emit", "y")] != batch.layout[("emit", "z")]

    alone_pool, alone_slots, alone_stores = setup()
    for k in "abcd":
        one = DecodeBatch(starts, [s.slot for s in alone_slots], alone_pool)
        one.plan_ring([k], 3)
        one.seal(torch.device("cpu"))
        assert torch.equal(batch[("first", k)], one[("first", k)]), k
        assert [(s[k].lo, s[k].end) for s in slots] == [(s[k].lo, s[k].end) for s in alone_slots], k
    for k in stores:
        one = DecodeBatch(starts, [s.slot for s in alone_slots], alone_pool)
        one.plan_append({k: alone_stores[k]}, 2, {k: 1}, torch.float32)
        one.seal(torch.device("cpu"))
        assert torch.equal(batch[("emit", k)], one[("emit", k)]), k
        assert [len(s) for s in stores[k]] == [len(s) for s in alone_stores[k]], k
        assert all(s.pool is batch.kv[k] for s in stores[k][:2])

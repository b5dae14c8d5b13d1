"""Model-level GPU benchmark (issue 5): DeepSeek-V4.1-Flash and V4-Flash slices at the real dimensions.

(a) V4.1-Flash slice: released layers 0, 1, 2, 3, 20, 21, 24, 25 (window, window + Engram, ratio-2 KV source,
    ratio-2 reuse, ratio-1 KV + candidate source = YOCO boundary, ratio-1 reuse, re-index, re-index reuse),
    random weights, reduced Engram table (``--engram-vocab`` buckets per head, FP8 rows), no DSpark head.
(b) V4-Flash 4-layer slice (CSA, HCA, CSA, HCA; first layer hash-routed: the peer slice of
    ../shared/docs/performance.md), ours and transformers 5.23.0's ``DeepseekV4ForCausalLM`` over the *same*
    weight tensors (logits compared in the same run).

Per model: prefill at 8K tokens against the tensor-core floor (FLOPs / bf16 matmul rate measured in this run);
decode at batch 1, 8, 64, 256 with a 4K and a 32K context, each step's time beside its memory floor (bytes of
weights the step touches + KV it reads, over the copy bandwidth measured in this run; the routed experts a step
touches are the mean per layer over ``FLOOR_DRAWS`` steps of random tokens, as the timed steps draw theirs anew
each step) and the ratio; each step
synchronised (host plan + device) and pipelined (steps launched back to back, as the engine's asynchronous
scheduling runs them: the larger of host and device time). Context
setup: one request is prefilled to the context length (timed: prefill at batch 1), then its cache is copied to
every request of the batch (``replicate_cache``: the engine's layout, paged growing rows and one slot pool, so a
decode step runs batched, ``decode_batch``): prefilling 256 x 32K tokens would take far longer than the run.
Prefill at batch > 1 runs where the estimate from the batch-1 rate fits ``--prefill-budget-s``; every
configuration that does not run says why. Issue 7: with batch invariance on, one request's logits alone vs
inside a batch of requests of other lengths (V4.1 slice, real shapes), compared bitwise.

Routing: the random top-k routers' selection biases (0.5 x N(0, 1), wider than the scores' spread) send most
tokens to the few experts they favour (~90 of V4.1's 384 take a batch-256 step's rows), which flatters the expert
GEMMs (few, tall experts) and shrinks a decode step's expert bytes; ``--routing balanced`` first sets them as a
trained model's load balancing does (``model_slice.balance_routers_``: every expert near the mean load). The JSON
records which ran (``routing``).

Weights today are bf16 (the model dequantises at load): the V4.1 slice's routed experts (384 x 2304 x 5120,
27 GB per layer in bf16) are one tensor pair shared by its 8 layers (``--v41-experts``) so that it fits one
GPU; a decode step still reads each hit expert from HBM. Floors are given for the format as run (bf16) and
for the released format (FP8/MXFP8 dense, MXFP4 experts; the issue's targets). ``--quant fp8+fp4`` keeps the
weights quantised in the model (``layers.quantize_weights_``: FP8 Linears through ``fp8_gemm_nt``, MXFP4 experts
through the MXFP4 grouped GEMMs); transformers is then not run (it needs the bf16 tensors).

    python benchmarks/gpu_model_slice.py [--out results.json] [--deadline-s 420]
    python benchmarks/gpu_model_slice.py --tiny --device cpu      # seconds-long CPU smoke run, tiny dims

An A/B of a tuning constant runs from one tree: the same command with and without ``--set MODULE.NAME=VALUE``
(``tuning_overrides.py``; recorded in the JSON's ``overrides``), alternating in one lease.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from tuning_overrides import apply_overrides

T0 = time.perf_counter()
PAGE_TOKENS = 128  # KV block size of the decode benchmark's paged rows (a multiple of every compression ratio)
FLOOR_DRAWS = 4  # routing draws (eager decode steps of random tokens) a decode floor's expert hits are the mean of


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def sync(dev) -> None:
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def prefill_record(tokens: int, seconds: float, flops: float, bf16_flops_per_s: float, **extra) -> dict:
    """One batch-1 prefill measurement against its tensor-core floor (flops at the measured bf16 rate)."""
    floor = flops / bf16_flops_per_s
    return dict(
        batch=1,
        tokens=tokens,
        seconds=seconds,
        tok_s=tokens / seconds,
        flops=flops,
        floor_s=floor,
        pct_of_floor=100 * floor / seconds,
        **extra,
    )


def pipelined(fn, dev, reps: int) -> tuple[float, float, float]:
    """Seconds per call of calls launched back to back, one sync at the end: how an engine with asynchronous
    scheduling runs decode steps (the host plans step N + 1 while the device runs step N), so the time per step is
    the larger of the host's and the device's, not their sum as in ``timed``. Returns (steady, wall, host):

    * steady: on CUDA, device time from the end of a first call to the end of ``reps`` more (CUDA events in
      stream order); the device waits whenever the host falls behind, so a host-bound step shows. The first
      call is the pipeline's fill: nothing overlaps its host planning, once per run of steps, not per step.
    * wall: host clock over all ``reps + 1`` calls, the fill included (the measure before session 16: at V4 batch
      256 the fill, ~5 ms of host planning spread over 10 steps, added ~0.5 ms to each).
    * host: host clock per call of the ``reps`` calls, without the final wait (a call never waits on the device):
      at or above steady, the step is host-bound and steady measures the host's planning, not the kernels.
    """
    sync(dev)
    t = time.perf_counter()
    cuda = torch.device(dev).type == "cuda"
    fn()
    if cuda:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
    t1 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        last.record()
    t2 = time.perf_counter()
    sync(dev)
    end = time.perf_counter()
    steady = first.elapsed_time(last) / 1e3 / reps if cuda else (end - t1) / reps
    return steady, (end - t) / (reps + 1), (t2 - t1) / reps


def timed(fn, dev, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return out


# ----------------------------------------------------------------------------------------------------------
# Ceilings measured in this run
# ----------------------------------------------------------------------------------------------------------
def ceilings(dev: str, tiny: bool) -> dict:
    if torch.device(dev).type != "cuda":
        return {"copy_GBps": 20.0, "bf16_TFLOPs": 0.5, "fp8_TFLOPs": None, "note": "CPU placeholders (not measured)"}

    def ev_ms(fn, reps=10):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    n = 1 << 31
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy = 2 * n / ev_ms(lambda x=x, y=y: y.copy_(x)) / 1e6
    del x, y
    m = 8192
    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    bf16 = 2 * m**3 / ev_ms(lambda a=a, b=b: a @ b) / 1e9
    fp8 = None
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        sa, sb = torch.ones(m, 1, device=dev), torch.ones(1, m, device=dev)
        fp8 = 2 * m**3 / ev_ms(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)) / 1e9
    except Exception as exc:  # noqa: BLE001
        log("fp8 _scaled_mm ceiling failed:", exc)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_GBps": copy, "bf16_TFLOPs": bf16, "fp8_TFLOPs": fp8}


# ----------------------------------------------------------------------------------------------------------
# Bytes and FLOPs
# ----------------------------------------------------------------------------------------------------------
class Accounting:
    """Weights, KV and FLOPs of a slice, as run (the model's storage) and in the released format."""

    def __init__(self, model, arch: str):
        from deepinfer_runtime.models.deepseek_v4_weights import BF16, FP32, LINEAR, v4_inventory
        from deepinfer_runtime.models.deepseek_v41_weights import v41_inventory

        self.model, self.cfg, self.arch = model, model.cfg, arch
        cfg = self.cfg
        inv = v41_inventory(cfg) if arch == "v4.1" else v4_inventory(cfg)
        role = {s.name: s.role for s in inv}
        fp8_scale = 1 / 1024 if arch == "v4.1" else 1 / (128 * 128)  # UE8M0 per 32x32 (V4.1) or 128x128 (V4)
        rel = {LINEAR: 1 + fp8_scale, BF16: 2, FP32: 4}
        n = cfg.num_hidden_layers
        self.dense_run = [0.0] * n
        self.dense_rel = [0.0] * n
        self.mm_params = [0] * n  # matmul weights per row (dense 2-D linears of the layer, gate included)
        self.other_run = self.other_rel = 0.0
        seen = set()
        stored = list(model.named_parameters(remove_duplicate=False))
        # weights kept quantised (Linear.qweight / .scale) are buffers, already in the released format
        stored += [(n, b) for n, b in model.named_buffers() if n.endswith((".qweight", ".scale"))]
        for name, p in stored:
            if id(p) in seen or ".experts." in name:
                continue
            seen.add(id(p))
            run = p.numel() * p.element_size()
            r = role.get(name) if isinstance(p, torch.nn.Parameter) else None
            relb = p.numel() * rel[r] if r in rel else run
            if name.startswith("layers."):
                i = int(name.split(".")[1])
                self.dense_run[i] += run
                self.dense_rel[i] += relb
                if p.dim() == 2 and not name.endswith("_fn"):
                    self.mm_params[i] += p.numel()
            elif name not in ("embed.weight",):
                self.other_run += run
                self.other_rel += relb
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        ex = model.layers[0].ffn.experts
        self.expert_params = 3 * inter * d
        if ex.quantized:  # MXFP4 packed codes + UE8M0 scales, per expert
            self.expert_run = sum(t.numel() * t.element_size() for t in ex.buffers()) / cfg.n_routed_experts
        else:
            self.expert_run = self.expert_params * ex.w13.element_size()
        self.expert_rel = self.expert_params * (0.5 + 1 / 32)  # MXFP4: E2M1 + one UE8M0 per 32
        self.embed_row_run = d * model.embed.weight.element_size()
        self.embed_row_rel = d * 2
        # Engram rows gathered per token: (max_ngram - 1) * n_heads rows of head_dim FP8 + 1 scale / 32
        self.engram_row = 0
        if arch == "v4.1" and cfg.engram_layer_ids:
            cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            self.engram_row = len(cfg.engram_layer_ids) * cols * cfg.engram_head_dim * (1 + 1 / 32)
        if arch == "v4.1":
            from deepinfer_runtime.models.deepseek_v41_cache_bytes import _records

            self.kv_rec = _records(cfg)  # released record bytes: window / compressed_kv / index_key
        else:
            self.kv_rec = None

    # --- KV read by one decode step of one request at context n --------------------------------------
    def kv_rows(self, n: int) -> list[tuple[str, float]]:
        """(kind, entries read) per layer for one request whose next token is at position n."""
        cfg, out = self.cfg, []
        w = cfg.sliding_window
        for layer in range(cfg.num_hidden_layers):
            out.append(("window", min(n + 1, w)))
            if self.arch == "v4.1":
                r = cfg.compress_ratio(layer)
                if not r:
                    continue
                vis = (n + 1) // r
                out.append(("compressed_kv", min(cfg.index_topk, vis)))
                if cfg.has_indexer(layer):
                    keys = vis
                    cand = cfg.candidate_source_layer_id
                    if cand is not None and cfg.kv_source_of(layer) == cand and layer != cand:
                        keys = min(vis, cfg.candidate_topk_blocks * cfg.candidate_block_size)
                    out.append(("index_key", keys))
            else:
                kind = cfg.layer_types[layer]
                if kind == "compressed_sparse_attention":
                    vis = (n + 1) // cfg.compress_rates[kind]
                    out.append(("index_key", vis))
                    out.append(("compressed_kv", min(cfg.index_topk, vis)))
                elif kind == "heavily_compressed_attention":
                    out.append(("compressed_kv", (n + 1) // cfg.compress_rates[kind]))
        return out

    def kv_bytes(self, n: int, released: bool) -> float:
        cfg = self.cfg
        width = {"window": cfg.head_dim, "compressed_kv": cfg.head_dim, "index_key": cfg.index_head_dim}
        total = 0.0
        for kind, rows in self.kv_rows(n):
            if released and self.kv_rec is not None:
                total += rows * self.kv_rec[kind]
            else:
                total += rows * width[kind] * 2  # bf16 latents as this model stores them
        return total

    def decode_floor_bytes(self, batch: int, n: int, hit: list[int], released: bool) -> dict:
        dense = sum(self.dense_rel if released else self.dense_run) + (self.other_rel if released else self.other_run)
        experts = sum(hit) * (self.expert_rel if released else self.expert_run)
        per_tok = (self.embed_row_rel if released else self.embed_row_run) + self.engram_row
        kv = batch * self.kv_bytes(n, released)
        return {"weights": dense + experts + batch * per_tok, "kv": kv, "total": dense + experts + batch * per_tok + kv}

    # --- prefill FLOPs of one request of S tokens from an empty cache -----------------------------------
    def prefill_flops(self, s: int, keep: int | None) -> float:
        cfg = self.cfg
        pos = torch.arange(s, dtype=torch.float64)
        h, dh = cfg.num_attention_heads, cfg.head_dim
        total = 0.0
        for layer in range(cfg.num_hidden_layers):
            rows = pos
            if self.arch == "v4.1" and keep is not None and layer >= cfg.n_prefill_layer:
                rows = pos[max(s - keep, 0) :]
            r_n = rows.numel()
            total += 2 * r_n * (self.mm_params[layer] + cfg.num_experts_per_tok * self.expert_params)
            keys = torch.clamp(rows + 1, max=cfg.sliding_window)
            if self.arch == "v4.1":
                r = cfg.compress_ratio(layer)
                if r:
                    vis = torch.div(rows + 1, r, rounding_mode="floor")
                    keys = keys + torch.clamp(vis, max=cfg.index_topk)
                    if cfg.has_indexer(layer):
                        total += float(2 * cfg.index_n_heads * cfg.index_head_dim * vis.sum())
            else:
                kind = cfg.layer_types[layer]
                if kind != "sliding_attention":
                    vis = torch.div(rows + 1, cfg.compress_rates[kind], rounding_mode="floor")
                    if kind == "compressed_sparse_attention":
                        keys = keys + torch.clamp(vis, max=cfg.index_topk)
                        total += float(2 * cfg.index_n_heads * cfg.index_head_dim * vis.sum())
                    else:
                        keys = keys + vis
            total += float(4 * h * dh * keys.sum())  # QK^T and PV
        total += 2 * cfg.hidden_size * cfg.vocab_size  # the head, last row only
        return total


# ----------------------------------------------------------------------------------------------------------
# Running our models
# ----------------------------------------------------------------------------------------------------------
class ExpertCounter:
    """Counts the distinct routed experts each MoE layer hits (forward hooks on the routers)."""

    def __init__(self, model):
        self.hit: dict[int, set] = {}
        self.handles = []
        # a graph replay runs no hooks (and a capture may not read the device): count on eager steps
        self.graphs = [(block, block.graphs) for block in model.layers]
        self.model, self.step_graphs = model, getattr(model, "step_graphs", None)
        model.step_graphs = None
        for i, block in enumerate(model.layers):
            block.graphs = None
            self.handles.append(block.ffn.gate.register_forward_hook(self._hook(i)))

    def _hook(self, i):
        def fn(_mod, _inp, out):
            self.hit.setdefault(i, set()).update(out[1].reshape(-1).tolist())

        return fn

    def close(self) -> list[int]:
        for h in self.handles:
            h.remove()
        for block, graphs in self.graphs:
            block.graphs = graphs
        self.model.step_graphs = self.step_graphs
        missing = [i for i in range(len(self.handles)) if not self.hit.get(i)]
        if missing:  # a floor without these layers' experts would be silently low
            raise RuntimeError(
                f"ExpertCounter: no routing seen in MoE layers {missing}; the models must route through "
                "Gate.forward for the decode floor to count their experts"
            )
        return [len(self.hit[i]) for i in sorted(self.hit)]


def rand_ids(n: int, dev, gen) -> torch.Tensor:
    return torch.randint(3, 129000, (n,), generator=gen).to(dev)


def prefill(model, arch, caches, prompts, chunk: int, dev) -> None:
    """Prefill each request's prompt; steps of at most ``chunk`` tokens (longer prompts chunked alone)."""

    def step(chunks, cs, lens):
        rows = [torch.tensor([c.shape[0] - 1]) for c in chunks]  # host tensors, as the engine passes them
        if arch == "v4.1":
            model.forward_step(chunks, cs, prompt_lens=lens, logit_rows=rows)
        else:
            model.forward_step(chunks, cs, logit_rows=rows)

    group, gcaches, glens, used = [], [], [], 0
    for c, p in zip(caches, prompts):
        if p.shape[0] > chunk:
            for s in range(0, p.shape[0], chunk):
                step([p[s : s + chunk]], [c], [p.shape[0]])
            continue
        if used + p.shape[0] > chunk and group:
            step(group, gcaches, glens)
            group, gcaches, glens, used = [], [], [], 0
        group.append(p)
        gcaches.append(c)
        glens.append(p.shape[0])
        used += p.shape[0]
    if group:
        step(group, gcaches, glens)


def decode_step(model, caches, toks) -> list[torch.Tensor]:
    return model.forward_step(list(toks.split(1)), caches)  # one [1] view per request, made in one call


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def bench_ours(model, arch, args, ceil, acct, deadline, results, label) -> None:
    from deepinfer_runtime.kv_pool import KVPools
    from deepinfer_runtime.testing.model_slice import replicate_cache

    dev = args.device
    gen = torch.Generator().manual_seed(1)
    keep = getattr(model, "yoco_keep", None) if getattr(model, "yoco_mode", "off") == "compact" else None
    rec = results.setdefault(label, {"prefill": [], "decode": [], "notes": []})
    copy_bps = ceil["copy_GBps"] * 1e9
    bf16 = ceil["bf16_TFLOPs"] * 1e12

    # warm-up (Triton compilation, allocator) on a short prompt + two decode steps
    c = model.new_cache()
    prefill(model, arch, [c], [rand_ids(args.warm_tokens, dev, gen)], args.chunk, dev)
    for _ in range(2):
        decode_step(model, [c], rand_ids(1, dev, gen))
    del c

    # prefill at the floor length (batch 1), twice: the first compiles what the warm-up did not
    s = args.prefill_tokens
    flops = acct.prefill_flops(s, keep)
    times = []
    for _ in range(2):
        if deadline.left() < 0:
            break
        c = model.new_cache()
        ids = rand_ids(s, dev, gen)
        times += timed(lambda c=c, ids=ids: prefill(model, arch, [c], [ids], args.chunk, dev), dev, 1)
        del c
    if times:
        t = times[-1]
        floor = flops / bf16
        rec["prefill"].append(prefill_record(s, t, flops, bf16, first_run_s=times[0], yoco_keep=keep))
        log(
            f"{label} prefill {s} tok: {t * 1e3:.0f} ms ({s / t:.0f} tok/s), floor {floor * 1e3:.1f} ms "
            f"({flops / 1e12:.1f} TFLOP at {ceil['bf16_TFLOPs']:.0f} TFLOP/s) = {100 * floor / t:.1f}% of floor"
        )
    else:
        rec["notes"].append(f"prefill {s}: not run (out of time budget)")

    rate8k = s / times[-1] if times else None
    for ctx in args.contexts:
        est = None if rate8k is None else 1.5 * ctx / rate8k * max(ctx / s, 1) ** 0.5
        if deadline.left() < 5 or (est is not None and est > deadline.left() - 10):
            msg = f"context {ctx}: not run (out of time budget; prefill estimated {est or 0:.0f} s)"
            rec["notes"].append(msg)
            log(label, msg)
            continue
        # the engine's layout: paged growing rows (one block table), fixed-size state in one slot pool per batch
        blocks = -(-ctx // PAGE_TOKENS)
        pools = KVPools(blocks + 2 * max(args.batches), PAGE_TOKENS, dev)
        table = list(range(blocks))
        base = model.new_cache(new_rows=pools.factory(table))
        ids = rand_ids(ctx, dev, gen)
        try:
            # once untimed into throwaway pools: the first prefill of a length compiles kernels for its shapes
            warm = model.new_cache(new_rows=KVPools(blocks + 1, PAGE_TOKENS, dev).factory(table))
            first = timed(lambda warm=warm, ids=ids: prefill(model, arch, [warm], [ids], args.chunk, dev), dev, 1)[0]
            del warm
            t = timed(lambda base=base, ids=ids: prefill(model, arch, [base], [ids], args.chunk, dev), dev, 1)[0]
        except torch.cuda.OutOfMemoryError as exc:
            msg = f"context {ctx}: prefill out of memory ({str(exc)[:120]})"
            rec["notes"].append(msg)
            log(label, msg)
            torch.cuda.empty_cache()
            continue
        rate = ctx / t
        pf = acct.prefill_flops(ctx, keep)
        rec["prefill"].append(prefill_record(ctx, t, pf, bf16, context=ctx, first_run_s=first))
        log(f"{label} prefill batch 1 x {ctx}: {t:.2f} s ({rate:.0f} tok/s, {100 * pf / bf16 / t:.1f}% of floor)")
        for b in args.batches:
            if b == 1:
                continue
            est = b * ctx / rate
            if est > args.prefill_budget_s or est > deadline.left() - 30:
                msg = (
                    f"prefill batch {b} x {ctx}: not run (estimated {est:.0f} s at the batch-1 rate "
                    f"> budget {min(args.prefill_budget_s, max(deadline.left() - 30, 0)):.0f} s)"
                )
                rec["notes"].append(msg)
                log(label, msg)
                continue
            cs = [model.new_cache() for _ in range(b)]
            ps = [rand_ids(ctx, dev, gen) for _ in range(b)]
            try:
                tb = timed(lambda cs=cs, ps=ps: prefill(model, arch, cs, ps, args.chunk, dev), dev, 1)[0]
                rec["prefill"].append(dict(batch=b, context=ctx, tokens=b * ctx, seconds=tb, tok_s=b * ctx / tb))
                log(f"{label} prefill batch {b} x {ctx}: {tb:.2f} s ({b * ctx / tb:.0f} tok/s)")
            except torch.cuda.OutOfMemoryError as exc:
                rec["notes"].append(f"prefill batch {b} x {ctx}: out of memory ({str(exc)[:100]})")
            del cs, ps
        for b in args.batches:
            if deadline.left() < 3:
                msg = f"decode batch {b} x {ctx}: not run (out of time budget)"
                rec["notes"].append(msg)
                log(label, msg)
                continue
            try:
                caches = replicate_cache(base, b, pools, table, iter(range(blocks, pools.num_blocks)))
                # every step's batch routes anew, and one draw's hits move the floor by up to ~8% at batch 8: the
                # floor takes the mean hits per layer of FLOOR_DRAWS eager steps (the first warms this batch up)
                draws = []
                for _ in range(FLOOR_DRAWS):
                    counter = ExpertCounter(model)
                    decode_step(model, caches, rand_ids(b, dev, gen))
                    draws.append(counter.close())
                hit = [statistics.fmean(layer) for layer in zip(*draws)]
                if getattr(model.layers[0], "graphs", None) is not None:  # capture outside the timed steps
                    for _ in range(2):  # whole-step graphs: the first step of a shape runs eagerly
                        decode_step(model, caches, rand_ids(b, dev, gen))
                steps = timed(lambda c=caches, b=b: decode_step(model, c, rand_ids(b, dev, gen)), dev, args.steps)
                # the same steps pipelined, the token ids drawn on the device (a host copy would wait for it)
                dgen = torch.Generator(device=dev).manual_seed(b)
                piped, piped_wall, piped_host = pipelined(
                    lambda c=caches, b=b, g=dgen: decode_step(
                        model, c, torch.randint(3, 129000, (b,), generator=g, device=dev)
                    ),
                    dev,
                    max(args.steps, 10),
                )
            except torch.cuda.OutOfMemoryError as exc:
                msg = f"decode batch {b} x {ctx}: out of memory ({str(exc)[:100]})"
                rec["notes"].append(msg)
                log(label, msg)
                caches = None
                torch.cuda.empty_cache()
                continue
            t = statistics.median(steps)
            run = acct.decode_floor_bytes(b, ctx, hit, released=False)
            relb = acct.decode_floor_bytes(b, ctx, hit, released=True)
            row = dict(
                batch=b,
                context=ctx,
                step_ms=t * 1e3,
                steps_ms=[x * 1e3 for x in steps],
                pipelined_ms=piped * 1e3,
                pipelined_wall_ms=piped_wall * 1e3,
                pipelined_host_ms=piped_host * 1e3,  # >= pipelined_ms: host-bound (the plan, not the kernels)
                tok_s=b / t,
                experts_hit=hit,
                experts_hit_draws=draws,
                bytes_as_run=run,
                bytes_released=relb,
                floor_ms_as_run=run["total"] / copy_bps * 1e3,
                floor_ms_released=relb["total"] / copy_bps * 1e3,
            )
            row["ratio_as_run"] = row["step_ms"] / row["floor_ms_as_run"]
            row["ratio_released"] = row["step_ms"] / row["floor_ms_released"]
            row["ratio_pipelined_as_run"] = row["pipelined_ms"] / row["floor_ms_as_run"]
            rec["decode"].append(row)
            log(
                f"{label} decode batch {b} x {ctx}: {t * 1e3:.1f} ms/step ({b / t:.0f} tok/s), pipelined "
                f"{piped * 1e3:.2f} ms/step (host {piped_host * 1e3:.2f}"
                f"{', host-bound' if piped_host >= piped else ''}); floor "
                f"{row['floor_ms_as_run']:.3f} ms as run (bf16, {run['total'] / 1e9:.2f} GB) -> "
                f"{row['ratio_as_run']:.1f}x, "
                f"{row['floor_ms_released']:.3f} ms released format ({relb['total'] / 1e9:.2f} GB) -> "
                f"{row['ratio_released']:.1f}x; experts hit/layer (mean of {len(draws)} draws) "
                f"{[round(h, 1) for h in hit]}"
            )
            del caches
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
        del base, pools
        if torch.device(dev).type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------------
def bench_hf(hf, ours, args, ceil, acct, deadline, results) -> None:
    dev = args.device
    rec = results.setdefault("v4_transformers", {"prefill": [], "decode": [], "notes": []})
    gen = torch.Generator().manual_seed(2)
    copy_bps = ceil["copy_GBps"] * 1e9
    cfg = ours.cfg

    def run_prefill(ids):
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.past_key_values

    with torch.inference_mode():
        pkv = run_prefill(torch.randint(3, 129000, (1, args.warm_tokens)).to(dev))  # warm-up
        hf(input_ids=torch.randint(3, 129000, (1, 1)).to(dev), past_key_values=pkv, use_cache=True)
        del pkv
        for ctx in args.contexts:
            for b in args.batches:
                if deadline.left() < 3:
                    rec["notes"].append(f"batch {b} x {ctx}: not run (out of time budget)")
                    continue
                # eager attention materialises [B, H, S, S] scores (bf16) plus fp32 softmax temporaries
                need = b * cfg.num_attention_heads * ctx * ctx * 2 * 3
                free = torch.cuda.mem_get_info()[0] if torch.device(dev).type == "cuda" else float("inf")
                if need > 0.8 * free:
                    msg = (
                        f"batch {b} x {ctx}: not run: eager attention scores need about {need / 2**30:.0f} GiB "
                        f"(free {free / 2**30:.0f} GiB)"
                    )
                    rec["notes"].append(msg)
                    log("transformers", msg)
                    continue
                ids = torch.randint(3, 129000, (b, ctx), generator=gen).to(dev)
                try:
                    sync(dev)
                    t0 = time.perf_counter()
                    pkv = run_prefill(ids)
                    sync(dev)
                    tp = time.perf_counter() - t0
                    nxt = torch.randint(3, 129000, (b, 1), generator=gen).to(dev)
                    hf(input_ids=nxt, past_key_values=pkv, use_cache=True)  # warm-up step
                    steps = timed(
                        lambda n=nxt, k=pkv: hf(input_ids=n, past_key_values=k, use_cache=True), dev, args.hf_steps
                    )
                except torch.cuda.OutOfMemoryError as exc:
                    msg = f"batch {b} x {ctx}: out of memory ({str(exc)[:100]})"
                    rec["notes"].append(msg)
                    log("transformers", msg)
                    pkv = None
                    torch.cuda.empty_cache()
                    continue
                t = statistics.median(steps)
                ref = next((r for r in results["v4_ours"]["decode"] if r["batch"] == b and r["context"] == ctx), None)
                hit = (
                    ref["experts_hit"]
                    if ref
                    else [min(cfg.n_routed_experts, b * cfg.num_experts_per_tok)] * len(ours.layers)
                )
                run = acct.decode_floor_bytes(b, ctx, hit, released=False)
                relb = acct.decode_floor_bytes(b, ctx, hit, released=True)
                row = dict(
                    batch=b,
                    context=ctx,
                    prefill_s=tp,
                    prefill_tok_s=b * ctx / tp,
                    step_ms=t * 1e3,
                    steps_ms=[x * 1e3 for x in steps],
                    tok_s=b / t,
                    floor_ms_as_run=run["total"] / copy_bps * 1e3,
                    floor_ms_released=relb["total"] / copy_bps * 1e3,
                )
                row["ratio_as_run"] = row["step_ms"] / row["floor_ms_as_run"]
                row["ratio_released"] = row["step_ms"] / row["floor_ms_released"]
                rec["prefill"].append(dict(batch=b, context=ctx, tokens=b * ctx, seconds=tp, tok_s=b * ctx / tp))
                rec["decode"].append(row)
                log(
                    f"transformers batch {b} x {ctx}: prefill {tp:.2f} s ({b * ctx / tp:.0f} tok/s), decode "
                    f"{t * 1e3:.1f} ms/step -> {row['ratio_as_run']:.1f}x floor as run"
                )
                del pkv
                if torch.device(dev).type == "cuda":
                    torch.cuda.empty_cache()
        # prefill at the floor length
        s = args.prefill_tokens
        if deadline.left() > 5:
            need = cfg.num_attention_heads * s * s * 2 * 3
            free = torch.cuda.mem_get_info()[0] if torch.device(dev).type == "cuda" else float("inf")
            if need < 0.8 * free:
                ids = torch.randint(3, 129000, (1, s), generator=gen).to(dev)
                t = timed(lambda: run_prefill(ids), dev, 1)[0]
                flops = acct.prefill_flops(s, None)
                floor = flops / (ceil["bf16_TFLOPs"] * 1e12)
                rec["prefill"].append(prefill_record(s, t, flops, ceil["bf16_TFLOPs"] * 1e12))
                log(f"transformers prefill {s}: {t * 1e3:.0f} ms = {100 * floor / t:.1f}% of floor")


def compare_v4_logits(model, hf, dev, n: int = 300) -> dict:
    """Same weights, same tokens: our logits vs transformers' (bf16 runs; fp32 logits)."""
    ids = torch.randint(3, 129000, (1, n), generator=torch.Generator().manual_seed(3)).to(dev)
    with torch.inference_mode():
        ours = model.forward_step([ids[0]], [model.new_cache()], logit_rows=[torch.arange(n - 8, n, device=dev)])[0]
        ref = hf(input_ids=ids, use_cache=False, logits_to_keep=8).logits[0].float()
    err = ((ours - ref).norm() / ref.norm()).item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"tokens": n, "rows": 8, "rel_l2_err": err, "argmax_agree": agree}


# ----------------------------------------------------------------------------------------------------------
# Batch invariance (issue 7)
# ----------------------------------------------------------------------------------------------------------
def invariance_check(model, dev, others=(33, 400, 1000, 7, 150), target_len=257, steps=3) -> dict:
    from deepinfer_kernels.registry import set_batch_invariant

    gen = torch.Generator().manual_seed(11)
    target = rand_ids(target_len, dev, gen)
    follow = rand_ids(steps, dev, gen)
    prompts = [rand_ids(n, dev, gen) for n in others]
    at = len(others) // 2

    def run(with_others: bool) -> list[torch.Tensor]:
        ps = prompts[:at] + [target] + prompts[at:] if with_others else [target]
        idx = at if with_others else 0
        caches = [model.new_cache() for _ in ps]
        rows = [torch.tensor([p.shape[0] - 1], device=dev) for p in ps]
        out = [model.forward_step(ps, caches, prompt_lens=[p.shape[0] for p in ps], logit_rows=rows)[idx]]
        for k in range(steps):
            toks = [follow[k : k + 1] if i == idx else rand_ids(1, dev, gen) for i in range(len(ps))]
            out.append(model.forward_step(toks, caches)[idx])
        return out

    set_batch_invariant(True)
    try:
        alone = run(False)
        batched = run(True)
    finally:
        set_batch_invariant(None)
    default_alone = run(False)
    equal = [bool(torch.equal(a, b)) for a, b in zip(alone, batched)]
    maxdiff = [float((a - b).abs().max()) for a, b in zip(alone, batched)]
    rel = [float((a - d).norm() / d.norm()) for a, d in zip(alone, default_alone)]
    return {
        "others": list(others),
        "target_len": target_len,
        "steps": 1 + steps,
        "bitwise_equal": equal,
        "max_abs_diff": maxdiff,
        "invariant_vs_default_rel_err": rel,
    }


# ----------------------------------------------------------------------------------------------------------
def tiny_dims(arch: str) -> dict:
    if arch == "v4.1":
        return dict(
            hidden_size=128,
            num_attention_heads=8,
            head_dim=128,
            qk_rope_head_dim=32,
            q_lora_rank=64,
            o_groups=4,
            o_lora_rank=32,
            n_routed_experts=16,
            moe_intermediate_size=64,
            index_n_heads=16,
            index_head_dim=64,
            index_topk=8,
            sliding_window=16,
            candidate_topk_blocks=4,
            candidate_block_size=4,
            engram_head_dim=64,
        )
    return dict(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=8,
        moe_intermediate_size=32,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=8,
        sliding_window=16,
        num_experts_per_tok=2,
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU smoke run)")
    p.add_argument("--models", default="v4,v4.1", help="comma list of v4, v4.1 (run in this order)")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="timed decode steps per configuration (median), and steps of the pipelined loop (at least 10, after "
        "one that fills the pipeline: its host planning is hidden behind no earlier step)",
    )
    p.add_argument("--hf-steps", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--warm-tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=8192, help="most tokens in one prefill step")
    p.add_argument("--prefill-budget-s", type=float, default=20.0)
    p.add_argument("--deadline-s", type=float, default=420.0, help="whole run; later configurations say 'not run'")
    p.add_argument("--v4-share", type=float, default=0.45, help="share of the deadline for the V4 section")
    p.add_argument("--engram-vocab", type=int, default=200_000)
    p.add_argument("--v41-experts", default="shared", choices=("shared", "distinct"))
    p.add_argument(
        "--engram",
        default="host",
        choices=("host", "device"),
        help="V4.1 Engram tables in pinned host memory (the loader's default on a GPU; read in place) or on the GPU",
    )
    p.add_argument(
        "--quant",
        default="none",
        choices=("none", "fp8+fp4"),
        help="keep weights quantised in the model (FP8/MXFP8 dense, MXFP4 experts) and use the GEMM ops",
    )
    p.add_argument(
        "--routing",
        default="random-bias",
        choices=("random-bias", "balanced"),
        help="the top-k routers' selection biases as drawn (0.5 x N(0, 1): most tokens go to the few experts they "
        "favour) or balanced as a trained model's are (model_slice.balance_routers_: every expert near the mean load)",
    )
    p.add_argument("--balance-tokens", type=int, default=8192, help="tokens of each --routing balanced round")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-invariance", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="whole decode steps from CUDA graphs")
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_model_slice.json"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="a tuning constant for this run (repeatable; tuning_overrides.py), e.g. "
        "deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES=4",
    )
    args = p.parse_args(argv)
    try:
        overrides = apply_overrides(args.set)
    except ValueError as exc:
        p.error(str(exc))
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.tiny:
        args.contexts = [64, 200][: len(args.contexts)]
        args.prefill_tokens = min(args.prefill_tokens, 96)
        args.warm_tokens = min(args.warm_tokens, 20)
        args.chunk = min(args.chunk, 64)
        args.batches = [b for b in args.batches if b <= 8]

    from deepinfer_runtime.testing import model_slice as ms

    dev = args.device
    results: dict = {
        "device": torch.cuda.get_device_name() if torch.device(dev).type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        # the switches that change what runs (DEEPINFER_PDL, DEEPINFER_SIDE_STREAMS, backend pins...): A/B records
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEEPINFER_")},
        "overrides": overrides,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(results, indent=1, default=str))

    ceil = ceilings(dev, args.tiny)
    results["ceilings"] = ceil
    log("ceilings:", json.dumps(ceil))
    save()
    total = Deadline(args.deadline_s)
    dtype = torch.bfloat16 if not args.tiny else torch.float32
    models = args.models.split(",")
    for arch in models:
        share = args.v4_share if (arch == "v4" and len(models) > 1) else 1.0
        dl = Deadline(max(total.left() * share, 0))
        label = "v4_ours" if arch == "v4" else "v41_ours"
        try:
            if arch == "v4":
                raw = ms.v4_slice_raw(**(tiny_dims("v4") if args.tiny else {}))
                cfg = ms.v4_slice_config(**(tiny_dims("v4") if args.tiny else {}))
                model = ms.build_random_model(cfg, dev, dtype, experts="distinct", quant=args.quant)
            else:
                cfg = ms.v41_slice_config(
                    engram_vocab_size=100 if args.tiny else args.engram_vocab,
                    **(tiny_dims("v4.1") if args.tiny else {}),
                )
                model = ms.build_random_model(
                    cfg, dev, dtype, experts=args.v41_experts, quant=args.quant, yoco_mode="compact",
                    engram_host=args.engram == "host",
                )  # fmt: skip
            routing = {"mode": args.routing}
            if args.routing == "balanced":  # before any graph is captured
                t0 = time.perf_counter()
                routing["max_over_mean"] = ms.balance_routers_(model, tokens=64 if args.tiny else args.balance_tokens)
                routing["seconds"] = time.perf_counter() - t0
                log(f"{label}: routers balanced, worst layer's max / mean expert load by round:",
                    " ".join(f"{r:.2f}" for r in routing["max_over_mean"]))  # fmt: skip
            if args.cuda_graphs:
                model.enable_cuda_graphs(max(args.batches))
            acct = Accounting(model, arch)
            held = {id(q): q for q in [*model.parameters(), *model.buffers()]}
            nbytes = sum(t.numel() * t.element_size() for t in held.values())
            results.setdefault(label, {"prefill": [], "decode": [], "notes": []})["weights_GB"] = nbytes / 1e9
            results[label]["routing"] = routing
            log(
                f"{label}: {cfg.num_hidden_layers} layers, {nbytes / 1e9:.1f} GB of weights on {dev}"
                + (f", experts {args.v41_experts}" if arch == "v4.1" else "")
            )
            hf = None
            if arch == "v4" and not args.no_hf and args.quant != "none":
                results["v4_transformers_error"] = "not run: transformers needs the bf16 weights (run without --quant)"
            elif arch == "v4" and not args.no_hf:
                try:
                    import transformers

                    hf = ms.hf_v4_sharing_weights(model, raw, dtype=dtype)
                    results["transformers_version"] = transformers.__version__
                    cmp = compare_v4_logits(model, hf, dev, n=300 if not args.tiny else 60)
                    results["v4_logits_vs_transformers"] = cmp
                    log("V4 ours vs transformers, same weights:", json.dumps(cmp))
                except Exception as exc:  # noqa: BLE001
                    results["v4_transformers_error"] = f"{type(exc).__name__}: {exc}"
                    log("transformers model failed:", traceback.format_exc())
                    hf = None
            if arch == "v4.1" and not args.no_invariance:
                try:
                    others = (5, 40, 90, 3, 17) if args.tiny else (33, 400, 1000, 7, 150)
                    inv = invariance_check(model, dev, others=others, target_len=57 if args.tiny else 257)
                    results["v41_batch_invariance"] = inv
                    log("V4.1 batch invariance:", json.dumps(inv))
                except Exception as exc:  # noqa: BLE001
                    results["v41_batch_invariance"] = {"error": f"{type(exc).__name__}: {exc}"}
                    log("invariance check failed:", traceback.format_exc())
            save()
            ours_dl = Deadline(dl.left() * (0.75 if hf is not None else 1.0))
            bench_ours(model, arch, args, ceil, acct, ours_dl, results, label)
            save()
            if hf is not None:
                bench_hf(hf, model, args, ceil, acct, dl, results)
                save()
        except Exception as exc:  # noqa: BLE001
            results.setdefault(label, {}).setdefault("notes", []).append(f"failed: {type(exc).__name__}: {exc}")
            log(f"{label} failed:", traceback.format_exc())
        finally:
            model = hf = acct = None
            if torch.device(dev).type == "cuda":
                torch.cuda.empty_cache()
        save()
    print_table(results)
    save()
    return results


def print_table(res: dict) -> None:
    c = res.get("ceilings", {})
    print(
        f"\n== ceilings: copy {c.get('copy_GBps', 0):.0f} GB/s, bf16 {c.get('bf16_TFLOPs', 0):.0f} TFLOP/s, "
        f"fp8 {c.get('fp8_TFLOPs') or 0:.0f} TFLOP/s"
    )
    fmt = "{:<16} {:>5} {:>6} {:>10} {:>9} {:>11} {:>8} {:>11} {:>8} {:>10} {:>8}"
    print(
        fmt.format(
            "decode", "batch", "ctx", "ms/step", "tok/s", "floor(run)", "ratio", "floor(rel)", "ratio", "pipelined",
            "ratio",
        )
    )  # fmt: skip
    for label in ("v41_ours", "v4_ours", "v4_transformers"):
        for r in res.get(label, {}).get("decode", []):
            print(
                fmt.format(
                    label,
                    r["batch"],
                    r["context"],
                    f"{r['step_ms']:.2f}",
                    f"{r['tok_s']:.0f}",
                    f"{r['floor_ms_as_run']:.3f}",
                    f"{r['ratio_as_run']:.1f}x",
                    f"{r['floor_ms_released']:.3f}",
                    f"{r['ratio_released']:.1f}x",
                    f"{r['pipelined_ms']:.2f}" if "pipelined_ms" in r else "-",
                    f"{r['ratio_pipelined_as_run']:.2f}x" if "pipelined_ms" in r else "-",
                )
                + (" host-bound" if r.get("pipelined_host_ms", 0) >= r.get("pipelined_ms", float("inf")) else "")
            )
    fmt = "{:<16} {:>5} {:>7} {:>9} {:>10} {:>11}"
    print(fmt.format("prefill", "batch", "tokens", "s", "tok/s", "% of floor"))
    for label in ("v41_ours", "v4_ours", "v4_transformers"):
        for r in res.get(label, {}).get("prefill", []):
            pct = f"{r['pct_of_floor']:.1f}%" if "pct_of_floor" in r else "-"
            print(fmt.format(label, r["batch"], r["tokens"], f"{r['seconds']:.3f}", f"{r['tok_s']:.0f}", pct))
    ours = {(r["batch"], r["context"]): r for r in res.get("v4_ours", {}).get("decode", [])}
    for r in res.get("v4_transformers", {}).get("decode", []):
        o = ours.get((r["batch"], r["context"]))
        if o:
            print(
                f"V4 decode batch {r['batch']} x {r['context']}: transformers {r['step_ms']:.1f} ms, ours "
                f"{o['step_ms']:.1f} ms -> speed-up {r['step_ms'] / o['step_ms']:.2f}x"
            )
    if "v4_logits_vs_transformers" in res:
        print("V4 logits vs transformers (same weights):", res["v4_logits_vs_transformers"])
    if "v41_batch_invariance" in res:
        print("V4.1 batch invariance (alone vs in a batch, bitwise per step):", res["v41_batch_invariance"])
    for label in ("v41_ours", "v4_ours"):
        routing = res.get(label, {}).get("routing")
        if routing:
            last = routing.get("max_over_mean") or []
            tail = f" (worst layer max / mean load {last[-1]:.2f})" if last else ""
            print(f"{label} routing: {routing['mode']}{tail}")
    for label in ("v41_ours", "v4_ours", "v4_transformers"):
        for note in res.get(label, {}).get("notes", []):
            print(f"{label}: {note}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a step's time goes (issue 5): torch.profiler and cProfile over a few decode steps (or prefills) of the
model slices of ``gpu_model_slice.py`` (V4-Flash 4-layer slice, V4.1-Flash 8-layer slice; real dimensions,
random weights).

Per model (and batch size) it prints the wall time per step, the GPU busy time per step (sum of kernel times:
the rest is the host's, i.e. Python and launch overhead), kernel launches and host syncs (``item`` /
``cudaStreamSynchronize``) per step, the top ops by host time and by GPU time, and the Python functions by own
and cumulative time. Writes JSON.

    python benchmarks/profile_step.py [--models v4,v4.1] [--batches 1,8] [--context 4096] [--out p.json]
    python benchmarks/profile_step.py --phase prefill --context 4096
    python benchmarks/profile_step.py --tiny --device cpu       # smoke run
    python benchmarks/profile_step.py --cuda-graphs --timeline --batches 1,64   # one graph step, kernel by kernel
    python benchmarks/profile_step.py --cuda-graphs --enqueue --batches 1,64,256  # host-bound or device-bound
    python benchmarks/profile_step.py --quant fp8+fp4 --cuda-graphs --timeline   # released formats (FP8, MXFP4)
    python benchmarks/profile_step.py ... --set deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES=4  # a tuning

``--enqueue`` (decode, CUDA): the host's time to plan and launch a step (until ``forward_step`` returns) against the
device's (CUDA events around it), synchronised, and the time per step launched back to back: the pipelined loop is
host-bound when the first exceeds the device's time.

``--timeline`` (decode, CUDA): the kernels of one step in start order with the gap before each, the step's GPU span
(first kernel start to last kernel end), busy time (the union of the kernels' intervals) and idle time, and the
kernels grouped by name (the floor ratio's GPU-side view, without the host's planning). Kernels overlap (programmatic
dependent launch, side streams), so each also gets its own time: what it adds to the span (``timeline_record``), and
its stream (the profiler's device resource id of a kernel event), summed per stream. In a graph replay these are
the graph's own streams, which the driver assigns to its concurrent branches (session 14's V4.1 batch-1 step used
eleven): they show which kernels ran beside which, not which ``SideStream`` lane enqueued them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tuning_overrides import apply_overrides

sys.path.insert(0, str(Path(__file__).parent))
from gpu_model_slice import PAGE_TOKENS, decode_step, pipelined, prefill, rand_ids, sync, tiny_dims  # noqa: E402


def _build(arch: str, dev: str, tiny: bool, quant: str = "none", routing: str = "random-bias"):
    """The slice ``gpu_model_slice.py`` runs, with its routers as drawn or balanced (its ``--routing``)."""
    from deepinfer_runtime.testing import model_slice as ms

    dims = tiny_dims(arch) if tiny else {}
    dtype = torch.float32 if tiny else torch.bfloat16
    if arch == "v4":
        model = ms.build_random_model(ms.v4_slice_config(**dims), dev, dtype, experts="distinct", quant=quant)
    else:
        cfg = ms.v41_slice_config(engram_vocab_size=100 if tiny else 200_000, **dims)
        model = ms.build_random_model(cfg, dev, dtype, experts="shared", quant=quant, yoco_mode="compact")
    if routing == "balanced":
        ratios = ms.balance_routers_(model, tokens=64 if tiny else 8192)
        print(f"{arch}: routers balanced, worst layer's max / mean expert load {ratios[-1]:.2f}", flush=True)
    return model


def _summary(prof, steps: int, top: int, shapes: bool = False) -> dict:
    events = prof.key_averages(group_by_input_shape=shapes)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) if kernels else 0.0

    def row(e, key):
        return {
            "op": e.key[:90] + (f" {e.input_shapes}"[:160] if shapes and e.input_shapes else ""),
            "calls_per_step": e.count / steps,
            "host_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "gpu_ms_per_step": getattr(e, "self_device_time_total", 0.0) / 1e3 / steps,
        }

    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    by_gpu = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0.0), reverse=True)[:top]
    syncs = sum(
        e.count
        for e in events
        if e.key in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")
    )
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_busy_ms_per_step": gpu_us / 1e3 / steps,
        "host_syncs_per_step": syncs / steps,
        "top_by_host": [row(e, "cpu") for e in by_host],
        "top_by_gpu": [row(e, "gpu") for e in by_gpu],
    }


def _profile(step, dev: str, steps: int, top: int, shapes: bool = False) -> dict:
    """Wall time of ``steps`` calls of ``step()`` (after 2 warm-up calls), then the same under torch.profiler
    (ops grouped by input shapes with ``shapes``) and under cProfile."""
    for _ in range(2):  # warm-up (compilation, allocator)
        step()
    sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    wall = (time.perf_counter() - start) / steps * 1e3
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(dev).type == "cuda" else [])
    with profile(activities=acts, record_shapes=shapes) as prof:
        for _ in range(steps):
            step()
        sync(dev)
    rec = {"wall_ms_per_step": wall, **_summary(prof, steps, top, shapes)}
    py = cProfile.Profile()  # the host side by Python function (where launches and syncs come from)
    py.enable()
    for _ in range(steps):
        step()
    sync(dev)
    py.disable()
    for key, order, n in (("python_by_tottime", "tottime", 2), ("python_by_cumtime", "cumtime", 3)):
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats(order).print_stats(top * n)
        rec[key] = text.getvalue()
    return rec


def timeline_record(kernels: list[tuple]) -> dict:
    """One step's kernels [(name, start us, end us[, stream])] in start order -> the timeline record.

    Kernels overlap: with programmatic dependent launch a kernel starts while the one before it ends (its first
    instruction waits), and kernels on a second stream run beside the main path. So each kernel carries its raw
    duration (``us``) and its own time (``own_us``): the part of it after every earlier-started kernel has ended,
    i.e. what it adds to the step's GPU span. The own times add up to ``busy_us``, the union of the intervals;
    ``idle_us`` = span - busy is time no kernel ran. Each order entry also has its ``start_us`` from the step's first
    kernel (critical paths, offline). Families are ranked by own time. With a stream per kernel, each
    order entry names it and ``streams`` sums kernels, raw and own time per stream (which work ran beside the main
    path, and what it still added to the span)."""
    if not kernels:
        return {
            "kernels": 0,
            "span_us": 0.0,
            "busy_us": 0.0,
            "idle_us": 0.0,
            "order": [],
            "families": [],
            "streams": {},
        }
    frontier = kernels[0][1]  # the latest end among the kernels started so far
    order, families, streams, busy = [], {}, {}, 0.0
    for name, start, end, *rest in kernels:
        own = max(0.0, end - max(start, frontier))
        entry = {
            "kernel": name[:110], "start_us": start - kernels[0][1], "gap_us": max(0.0, start - frontier),
            "us": end - start, "own_us": own,
        }  # fmt: skip
        if rest and rest[0] is not None:
            entry["stream"] = rest[0]
            st = streams.setdefault(str(rest[0]), {"kernels": 0, "us": 0.0, "own_us": 0.0})
            st["kernels"] += 1
            st["us"] += end - start
            st["own_us"] += own
        order.append(entry)
        fam = families.setdefault(name[:60], [0, 0.0, 0.0])
        fam[0] += 1
        fam[1] += end - start
        fam[2] += own
        busy += own
        frontier = max(frontier, end)
    span = frontier - kernels[0][1]
    top = sorted(families.items(), key=lambda kv: -kv[1][2])
    return {
        "kernels": len(kernels), "span_us": span, "busy_us": busy, "idle_us": span - busy, "order": order,
        "families": [{"kernel": k, "calls": c, "us": t, "own_us": o} for k, (c, t, o) in top], "streams": streams,
    }  # fmt: skip


def _timeline(step, steps: int = 3) -> dict:
    """One decode step's kernels in order (after 2 warm-up steps): the steps are told apart by host gaps of more
    than 100 us between kernels, and the largest group is taken (a step replayed from a CUDA graph is one)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    groups, cur, frontier = [], kernels[:1], kernels[0].time_range.end if kernels else 0.0
    for e in kernels[1:]:
        if e.time_range.start - frontier > 100:
            groups.append(cur)
            cur = []
        cur.append(e)
        frontier = max(frontier, e.time_range.end)
    groups.append(cur)
    one = max(groups, key=len)
    # a kernel event's device resource is its CUDA stream
    return timeline_record(
        [(e.name, e.time_range.start, e.time_range.end, getattr(e, "device_resource_id", None)) for e in one]
    )


def _enqueue(step, steps: int = 10) -> dict:
    """Median host enqueue ms (``step()`` returning), device ms (events around it) and synchronised ms of ``steps``
    single steps, then the ms per step of ``steps`` steps launched back to back (``pipelined``: steady state, and
    the wall clock with the pipeline's fill)."""
    for _ in range(3):
        step()
    host, device, total = [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        total.append((time.perf_counter() - t0) * 1e3)
        device.append(start.elapsed_time(end))
    med = statistics.median
    piped, wall, piped_host = pipelined(step, "cuda", steps)
    return {
        "host_enqueue_ms": med(host), "device_ms": med(device), "sync_ms": med(total), "pipelined_ms": piped * 1e3,
        "pipelined_wall_ms": wall * 1e3, "pipelined_host_ms": piped_host * 1e3,
    }  # fmt: skip


def _print_timeline(title: str, rec: dict, show: int = 30) -> None:
    print(
        f"\n== {title}: {rec['kernels']} kernels, GPU span {rec['span_us']:.0f} us, busy {rec['busy_us']:.0f} us, "
        f"idle {rec['idle_us']:.0f} us (own = a kernel's time after every earlier-started one ended)"
    )
    for f in rec["families"][:show]:
        print(f"   {f['own_us']:9.1f} us own {f['us']:9.1f} us raw {f['calls']:4d}  {f['kernel']}")
    for stream, st in rec.get("streams", {}).items():
        print(f"   stream {stream}: {st['kernels']} kernels, {st['us']:.0f} us raw, {st['own_us']:.0f} us own")


def _print(title: str, rec: dict, steps: int, top: int) -> None:
    print(
        f"\n== {title}: {rec['wall_ms_per_step']:.2f} ms/step wall, GPU busy {rec['gpu_busy_ms_per_step']:.2f} ms, "
        f"{rec['kernels_per_step']:.0f} kernels, {rec['host_syncs_per_step']:.0f} host syncs per step"
    )
    for name, key, col in (("host", "top_by_host", "host_ms_per_step"), ("GPU", "top_by_gpu", "gpu_ms_per_step")):
        print(f"-- top by {name} time (ms/step, calls/step)")
        for r in rec[key]:
            print(f"   {r[col]:9.3f}  {r['calls_per_step']:7.1f}  {r['op']}")
    for key, n in (("python_by_tottime", 2), ("python_by_cumtime", 3)):
        print(f"-- Python functions, {key.split('_')[-1]} ({steps} steps)")
        lines = rec[key].splitlines()
        first = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print("\n".join(line.replace(str(Path.cwd()), ".") for line in lines[first : first + top * n + 1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--models", default="v4,v4.1")
    ap.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="decode: context; prefill: prompt tokens")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cuda-graphs", action="store_true", help="decode steps from CUDA graphs (enable_cuda_graphs)")
    ap.add_argument("--shapes", action="store_true", help="group ops by input shapes (eager steps show them)")
    ap.add_argument("--timeline", action="store_true", help="decode on CUDA: one step's kernels in order, by family")
    ap.add_argument("--enqueue", action="store_true", help="decode on CUDA: host enqueue vs device time of a step")
    ap.add_argument(
        "--quant",
        default="none",
        choices=("none", "fp8+fp4"),
        help="weights kept quantised in the model, as gpu_model_slice.py --quant",
    )
    ap.add_argument(
        "--routing", default="random-bias", choices=("random-bias", "balanced"), help="as gpu_model_slice.py"
    )
    ap.add_argument("--out", type=Path, default=Path("profile_step.json"))
    ap.add_argument(
        "--set", action="append", default=[], metavar="MODULE.NAME=VALUE", help="a tuning constant (tuning_overrides)"
    )
    args = ap.parse_args()
    try:
        overrides = apply_overrides(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    from deepinfer_runtime.kv_pool import KVPools
    from deepinfer_runtime.testing.model_slice import replicate_cache

    dev, gen, results = args.device, torch.Generator().manual_seed(0), {}
    for arch in args.models.split(","):
        model = _build(arch, dev, args.tiny, args.quant, args.routing)
        if args.phase == "prefill":
            ids = rand_ids(args.context, dev, gen)

            def step(m=model, a=arch, ids=ids):
                prefill(m, a, [m.new_cache()], [ids], 8192, dev)

            rec = _profile(step, dev, args.steps, args.top, args.shapes)
            results[f"{arch} prefill {args.context}"] = rec
            _print(f"{arch} prefill of {args.context} tokens (one request)", rec, args.steps, args.top)
        else:
            batches = [int(x) for x in args.batches.split(",")]
            if args.cuda_graphs:
                model.enable_cuda_graphs(max(batches))
            blocks = -(-args.context // PAGE_TOKENS)
            pools = KVPools(blocks + 2 * max(batches), PAGE_TOKENS, dev)
            table = list(range(blocks))
            base = model.new_cache(new_rows=pools.factory(table))  # the engine's layout (gpu_model_slice)
            prefill(model, arch, [base], [rand_ids(args.context, dev, gen)], 8192, dev)
            for b in batches:
                caches = replicate_cache(base, b, pools, table, iter(range(blocks, pools.num_blocks)))
                if args.enqueue and torch.device(dev).type == "cuda":
                    dgen = torch.Generator(device=dev).manual_seed(b)  # token ids drawn on the device: no host copy
                    rec = _enqueue(
                        lambda m=model, c=caches, b=b, g=dgen: decode_step(
                            m, c, torch.randint(3, 129000, (b,), generator=g, device=dev)
                        )
                    )
                    results[f"{arch} b{b} enqueue"] = rec
                    print(f"{arch} decode batch {b}: " + ", ".join(f"{k} {v:.2f}" for k, v in rec.items()), flush=True)
                    caches = None
                    continue
                if args.timeline and torch.device(dev).type == "cuda":
                    rec = _timeline(lambda m=model, c=caches, b=b: decode_step(m, c, rand_ids(b, dev, gen)))
                    results[f"{arch} b{b} timeline"] = rec
                    _print_timeline(f"{arch} decode batch {b}, context {args.context}", rec)
                    caches = None
                    continue
                rec = _profile(
                    lambda m=model, c=caches, b=b: decode_step(m, c, rand_ids(b, dev, gen)),
                    dev,
                    args.steps,
                    args.top,
                    args.shapes,
                )
                results[f"{arch} b{b}"] = rec
                _print(f"{arch} decode batch {b}, context {args.context}", rec, args.steps, args.top)
                caches = None
            base = pools = None
        model = None
        if torch.device(dev).type == "cuda":
            torch.cuda.empty_cache()
    if overrides:
        results["overrides"] = overrides
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

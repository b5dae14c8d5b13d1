"""Shared helpers of the kernel microbenchmarks: timing, the ceilings measured in the same run, and the
JSON-lines output under ``benchmarks/results/`` (repository root, gitignored)."""

import json
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def bench_ms(fn, *args, **kwargs) -> float:
    """Median milliseconds per call of ``fn(*args, **kwargs)`` (triton.testing.do_bench, 25 ms warmup,
    100 ms of repetitions, L2 flushed between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median"))


def graph_us(fn, reps: int = 20) -> float:
    """Device microseconds per call of ``fn()`` replayed from a CUDA graph of ``reps`` back-to-back calls (median
    of 15 replays): a decode step's view of a small kernel, without the host's launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def cold_us(fn, reps: int = 10, flush_mb: int = 256) -> float:
    """Device microseconds per call of ``fn()`` when each call follows a ``flush_mb`` MB device copy (a graph of
    ``reps`` x [copy, call] less one of ``reps`` copies; medians of 15 replays): a decode step's view of a kernel
    that runs once between weight streams, which evict its code and data from the L2 (``graph_us`` keeps both
    warm)."""
    src = torch.empty(flush_mb << 19, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    both = graph_us(lambda: (dst.copy_(src), fn()), reps) * reps
    copies = graph_us(lambda: dst.copy_(src), reps) * reps
    return (both - copies) / reps


def wall_us(fn, *args, calls: int = 100) -> float:
    """Host wall time per call (us) of ``calls`` back-to-back calls, synchronised once at the end (what a
    launch-bound caller pays, unlike ``bench_ms``'s device time)."""
    fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def copy_ceiling_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a 1 GiB buffer, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(dst.copy_, src)
    return 2 * nbytes / ms / 1e6


def matmul_ceiling_tflops(n: int = 8192) -> float:
    """bf16 n x n x n torch.matmul (cuBLAS) throughput, TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(torch.matmul, a, b)
    return 2 * n**3 / ms / 1e9


class Recorder:
    """Prints one line per measurement and appends it as JSON to ``RESULTS / <name>.jsonl``."""

    def __init__(self, name: str):
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS / f"{name}.jsonl"
        self.meta = {
            "bench": name,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def add(self, **row) -> None:
        row = {**self.meta, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k not in self.meta}
        print("  ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

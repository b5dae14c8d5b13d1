"""Microbenchmark of ``moe_experts`` over dense bf16 expert stacks on the GPU at V4-Flash shapes (256 experts,
hidden 4096, width 2048, top-6): the reference (a Python loop over the hit experts with fp32 weight copies)
against the Triton backend (``grouped_gemm[_gather]`` + ``moe_permute`` / ``moe_unpermute``).

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_grouped_gemm.py [--quick]

Ceilings in the same run (copy GB/s, bf16 matmul TFLOP/s), then for T tokens (1, 8, 64, 256, 4096): the
reference, the Triton backend as dispatched (its layout picked from the shapes), both Triton layouts forced
(T <= 256) and the Triton backend replayed from a CUDA graph (T <= 256: GPU time without the launch overhead;
it also shows the path never synchronises with the host). Bytes = bf16 weights of the experts hit + x and
the output (bf16); FLOPs = 6 T k I d (gate, up and down). ``--sweep`` times other tilings of each layout and
checks that they give the same bits as the default ones; ``--threshold`` times both layouts around the size
where ``moe_experts`` switches from the gathered to the sorted one.
Appends JSON lines to benchmarks/results/grouped_gemm.jsonl; prints a short table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, matmul_ceiling_tflops  # noqa: E402
from deepinfer_kernels.ops.grouped_gemm import triton as backend  # noqa: E402
from deepinfer_kernels.ops.moe import triton as moe_backend  # noqa: E402
from deepinfer_kernels.ops.moe.reference import moe_experts_ref  # noqa: E402

E, D, INTER, TOP_K, LIMIT = 256, 4096, 2048, 6, 10.0


def stacks():
    g = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(E, 2 * INTER, D, generator=g, device="cuda", dtype=torch.bfloat16) * (3 / D**0.5)
    w2 = torch.randn(E, D, INTER, generator=g, device="cuda", dtype=torch.bfloat16) * (1 / INTER**0.5)
    return w13, w2


def tokens(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    experts = torch.rand(t, E, generator=g, device="cuda").argsort(1)[:, :TOP_K]
    weights = torch.rand(t, TOP_K, generator=g, device="cuda") + 0.1
    return x, experts, weights


def graph_ms(fn) -> float:
    """Milliseconds per replay of ``fn`` captured in a CUDA graph (after a warm-up call on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def moe_call(x, experts, weights, w13, w2):
    """The Triton backend of moe_experts on these inputs, as a function of nothing."""
    return lambda: moe_backend.moe_experts_triton(x, experts, weights, w13, w2, swiglu_limit=LIMIT)


def graph_row(rec, row, w13, w2) -> None:
    """Add the CUDA-graph replay time of the Triton backend at row["T"] tokens."""
    x, experts, weights = tokens(row["T"])
    try:
        row["graph_ms"] = graph_ms(moe_call(x, experts, weights, w13, w2))
        rec.add(kind="moe_experts", T=row["T"], impl="triton_graph", ms=row["graph_ms"])
    except RuntimeError as exc:
        print(f"T={row['T']}: CUDA graph capture failed: {exc}", flush=True)


def with_layout(gather: bool, fn):
    """fn with ``moe_experts_triton``'s layout forced."""

    def run():
        saved = moe_backend.gather_layout
        moe_backend.gather_layout = lambda t, k, e: gather
        try:
            return fn()
        finally:
            moe_backend.gather_layout = saved

    return run


def bench_tokens(rec, ceil, t, w13, w2, with_reference=True) -> dict:
    x, experts, weights = tokens(t)
    hit = int(torch.unique(experts).numel())
    nbytes = hit * 3 * INTER * D * 2 + 2 * t * D * 2
    flops = 6 * t * TOP_K * INTER * D

    triton = moe_call(x, experts, weights, w13, w2)
    cands = {"triton": triton}
    if with_reference:
        cands["reference"] = lambda: moe_experts_ref(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
    if t <= 256:
        cands["gather"] = with_layout(True, triton)
        cands["contiguous"] = with_layout(False, triton)
    row = {"T": t, "experts_hit": hit, "layout": "gather" if moe_backend.gather_layout(t, TOP_K, E) else "contiguous"}
    for name, fn in cands.items():
        ms = bench_ms(fn)
        row[name + "_ms"] = ms
        rec.add(kind="moe_experts", T=t, impl=name, ms=ms, GBps=nbytes / ms / 1e6, TFLOPs=flops / ms / 1e9)
    ms = row["triton_ms"]
    row.update(GBps=nbytes / ms / 1e6, TFLOPs=flops / ms / 1e9)
    row["%copy"] = 100 * row["GBps"] / ceil["copy_GBps"]
    row["%bf16"] = 100 * row["TFLOPs"] / ceil["bf16_TFLOPs"]
    if "reference_ms" in row:
        row["speedup"] = row["reference_ms"] / ms
    return row


def down_input_cost(rec, w13, w2) -> None:
    """The down projection at 4096 tokens with its fp32 input (three exact bf16 terms, what moe_experts runs)
    against the same input rounded to bf16 (one term): the price of never rounding it."""
    x, experts, weights = tokens(4096)
    from deepinfer_kernels.ops.moe_permute import moe_permute

    xs, order, offsets = moe_permute(x, experts, E)
    h = backend.grouped_gemm_triton(xs, w13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT, out_dtype=torch.float32)
    for name, inp in (("fp32_input", h), ("bf16_input", h.to(torch.bfloat16))):
        ms = bench_ms(lambda inp=inp: backend.grouped_gemm_triton(inp, w2, offsets, out_dtype=torch.float32))
        rec.add(kind="down_4096", impl=name, ms=ms, TFLOPs=2 * h.shape[0] * D * INTER / ms / 1e9)
    ms = bench_ms(lambda: backend.grouped_gemm_triton(xs, w13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT,
                                                      out_dtype=torch.float32))  # fmt: skip
    rec.add(kind="gate_up_4096", impl="bf16_input", ms=ms, TFLOPs=4 * h.shape[0] * D * INTER / ms / 1e9)


GATHER_SWEEP = [  # (BLOCK_M, BLOCK_N, BLOCK_N_SWIGLU, BLOCK_K, num_warps, num_stages); the first is the default
    (64, 128, 64, 64, 4, 4),
    (64, 128, 32, 64, 4, 4),
    (64, 128, 64, 64, 4, 6),
    (64, 64, 64, 64, 4, 4),
    # one live row per tile: smaller BLOCK_M frees shared memory for more stages / resident programs
    (16, 128, 64, 64, 4, 4),
    (16, 128, 64, 64, 4, 6),
    (16, 64, 64, 64, 4, 6),
    (16, 256, 64, 64, 8, 4),
    (32, 128, 64, 64, 4, 5),
]
GROUPED_SWEEP = [  # the wide contiguous tiling (4096 tokens)
    (128, 256, 128, 64, 8, 4),
    (128, 256, 128, 64, 8, 3),
    (128, 128, 128, 64, 8, 4),
    (128, 256, 64, 64, 8, 4),
    (256, 128, 64, 64, 8, 3),
]


def sweep(rec, w13, w2) -> None:
    """Time tilings of each layout (gathered: 1 and 8 tokens, replayed from a CUDA graph; contiguous: 4096
    tokens) and compare their bits with the default tiling's."""
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_N_SWIGLU", "BLOCK_K", "num_warps", "num_stages")
    for name, cfg, points, sizes in (
        ("gather", backend.GATHER_CFG[torch.bfloat16], GATHER_SWEEP, (1, 8)),
        ("contiguous", backend.GROUPED_WIDE_CFG, GROUPED_SWEEP, (4096,)),
    ):
        saved = dict(cfg)
        first = {}
        for point in points:
            cfg.update(zip(keys, point))
            res = {}
            for t in sizes:
                run = moe_call(*tokens(t), w13, w2)
                try:
                    out = run()
                    res[f"T{t}_ms"] = graph_ms(run) if t <= 256 else bench_ms(run)
                except Exception as exc:  # out of shared memory / registers: skip the point
                    print(f"{name} {point}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    break
                first.setdefault(t, out)
                res[f"T{t}_same_bits"] = bool(torch.equal(out, first[t]))
            rec.add(kind="sweep", layout=name, cfg=point, **res)
        cfg.update(saved)


def threshold(rec, w13, w2) -> None:
    """Both layouts at the sizes around ``gather_layout``'s threshold, eager and from CUDA graphs."""
    for t in (8, 16, 21, 22, 32, 64):
        x, experts, weights = tokens(t)
        res = {}
        for name, gather in (("gather", True), ("contiguous", False)):
            fn = with_layout(gather, moe_call(x, experts, weights, w13, w2))
            res[name + "_eager_ms"] = bench_ms(fn)
            res[name + "_graph_ms"] = graph_ms(fn)  # the layout is forced while the graph is captured
        rec.add(kind="threshold", T=t, dispatched="gather" if moe_backend.gather_layout(t, TOP_K, E) else "contiguous",
                **res)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T in (1, 64, 4096)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the tilings")
    ap.add_argument("--threshold", action="store_true", help="also time both layouts around the threshold")
    args = ap.parse_args()
    t_sizes = [1, 64, 4096] if args.quick else [1, 8, 64, 256, 4096]
    ceil = {"copy_GBps": copy_ceiling_gbs(), "bf16_TFLOPs": matmul_ceiling_tflops()}
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    rec = Recorder("grouped_gemm")
    rec.add(kind="ceilings", **ceil)
    w13, w2 = stacks()
    table = [bench_tokens(rec, ceil, t, w13, w2) for t in t_sizes]
    down_input_cost(rec, w13, w2)
    if args.sweep:
        sweep(rec, w13, w2)
    if args.threshold:
        threshold(rec, w13, w2)
    for row in table:  # last: a refused capture (a host synchronisation in the path) may spoil the context
        if row["T"] <= 256:
            graph_row(rec, row, w13, w2)
    print("\n== moe_experts, dense bf16 experts, V4-Flash (ms; GB/s, TFLOP/s and % of ceilings for Triton as "
          "dispatched)")  # fmt: skip
    cols = ["T", "experts_hit", "layout", "reference_ms", "triton_ms", "graph_ms", "gather_ms", "contiguous_ms",
            "speedup", "GBps", "%copy", "TFLOPs", "%bf16"]  # fmt: skip
    print("  ".join(f"{c:>13}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>13.4g}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>13}" for c in cols))


if __name__ == "__main__":
    main()

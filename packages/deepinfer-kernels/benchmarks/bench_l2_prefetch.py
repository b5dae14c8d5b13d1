"""``l2_prefetch`` microbenchmark (CUDA, sm_90+): what warming L2 during a latency-bound gap saves the weight
stream that follows it, at V4-Flash's decode shapes (one token).

Each case is a CUDA graph of 10 repetitions of: a 256 MB copy (evicts the L2, as the step's other weight streams
do), then on the main stream a gap of ``--gaps`` microseconds (a spinning one-program kernel: the norms, attention
core or routing a decode step runs between two weight streams, which leave HBM idle) and the consumer, the op that
streams the weight; beside the gap, forked after the copy, ``l2_prefetch`` of the consumer's weights. The consumer's
effective time is the repetition's time less that of [copy, gap] alone, so a saving is what the step would save.
Budgets are MB prefetched over all of a consumer's weights (each weight its share), as a prefix of each weight
(``period`` 0) or the leading part of every row (``period`` = one row); ``--evict-last`` adds the L2::evict_last
policy's rows.

Consumers: V4's wo_b (``linear``, 8192 -> 4096), wo_a (``grouped_linear``, 8 x 4096 -> 1024), wq_b (``linear``,
1024 -> 32768), a CSA layer's projections of its normed input (``linear_many``, wq_a / wkv / compressor
wkv and gate), the shared expert's gate and up (``linear_many``) and the LM head (``linear``, 4096 -> 129280).

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_l2_prefetch.py``.
Writes ``benchmarks/results/bench_l2_prefetch.jsonl``; a table last.
"""

import argparse

import torch
from _bench_util import Recorder, copy_ceiling_gbs, graph_us
from deepinfer_kernels.ops.grouped_linear import grouped_linear
from deepinfer_kernels.ops.l2_prefetch import l2_prefetch
from deepinfer_kernels.ops.l2_prefetch import triton as backend
from deepinfer_kernels.ops.linear import linear
from deepinfer_kernels.ops.linear_many import linear_many

REPS = 10
CYCLES_PER_US = 1980  # the H200's boost clock: torch.cuda._sleep spins this many cycles a microsecond


def consumers(dev) -> dict:
    """name -> (weights, fn() that streams them once at one token)."""
    bf = dict(device=dev, dtype=torch.bfloat16)
    w = lambda n, k: torch.randn(n, k, **bf) * 0.02  # noqa: E731
    x = lambda k: torch.randn(1, k, **bf)  # noqa: E731
    wo_b, wo_a, wq_b, head = w(4096, 8192), w(8192, 4096), w(32768, 1024), w(129280, 4096)
    proj = [w(1024, 4096), w(512, 4096), w(1024, 4096), w(1024, 4096)]
    shared = [w(2048, 4096), w(2048, 4096)]
    x8k, x1k, x4k, o = x(8192), x(1024), x(4096), torch.randn(1, 8, 4096, **bf)
    f32 = torch.float32
    return {
        "wo_b": ([wo_b], lambda: linear(x8k, wo_b)),
        "wo_a": ([wo_a], lambda: grouped_linear(o, wo_a)),
        "wq_b": ([wq_b], lambda: linear(x1k, wq_b)),
        "csa_proj": (proj, lambda: linear_many(x4k, proj, [None, None, f32, f32])),
        "shared_gate_up": (shared, lambda: linear_many(x4k, shared)),
        "lm_head": ([head], lambda: linear(x4k, head)),
    }


def prefetch(weights: list[torch.Tensor], budget: int, by_row: bool) -> None:
    total = sum(t.numel() * t.element_size() for t in weights)
    for t in weights:
        nbytes = t.numel() * t.element_size()
        l2_prefetch(t, min(nbytes, budget * nbytes // total), t.shape[-1] * t.element_size() if by_row else 0)


def rep_us(body, flush) -> float:
    """Device microseconds per repetition of [flush copy, body()], REPS of them in a graph (``graph_us``)."""
    return graph_us(lambda: (flush(), body()), REPS)


def consumer_us(spin: int, weights, fn, budget: int, by_row: bool, flush, side, idle: float) -> float:
    """The consumer's effective time after a gap of ``spin`` cycles with ``budget`` bytes prefetched beside it."""

    def body() -> None:
        if budget:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(weights, budget, by_row)
        torch.cuda._sleep(spin)
        fn()
        if budget:
            torch.cuda.current_stream().wait_stream(side)

    return rep_us(body, flush) - idle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gaps", default="8,14", help="idle microseconds before the consumer")
    ap.add_argument("--budgets", default="0,8,16,24,32,40", help="MB prefetched over the consumer's weights")
    ap.add_argument("--only", default="", help="comma-separated consumers (default: all)")
    ap.add_argument("--evict-last", action="store_true", help="also the rows with the L2::evict_last policy")
    args = ap.parse_args()
    rec = Recorder("bench_l2_prefetch")
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbs()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rec.add(case="ceilings", copy_gbs=ceiling, l2_mb=l2 / 2**20)
    src = torch.empty(128 << 20, dtype=torch.int16, device=dev)
    dst = torch.empty_like(src)
    flush = lambda: dst.copy_(src)  # noqa: E731
    side = torch.cuda.Stream(priority=-2)
    table = []
    cases = consumers(dev)
    only = [c for c in args.only.split(",") if c] or list(cases)
    for gap in [float(g) for g in args.gaps.split(",")]:
        spin = int(gap * CYCLES_PER_US)
        idle = rep_us(lambda spin=spin: torch.cuda._sleep(spin), flush)
        for name in only:
            weights, fn = cases[name]
            mb = sum(t.numel() * t.element_size() for t in weights) / 1e6
            base = None
            for evict in (False, True) if args.evict_last else (False,):
                backend.EVICT_LAST = evict
                for budget_mb in [int(b) for b in args.budgets.split(",")]:
                    for by_row in (False, True) if budget_mb else (False,):
                        if evict and not budget_mb:
                            continue
                        us = consumer_us(spin, weights, fn, budget_mb << 20, by_row, flush, side, idle)
                        base = us if base is None else base
                        layout = "-" if not budget_mb else "rows" if by_row else "prefix"
                        rec.add(case="consumer", consumer=name, weights_mb=mb, gap_us=gap, budget_mb=budget_mb,
                                layout=layout, evict_last=evict, us=us, saved_us=base - us,
                                pct_copy=100 * mb * 1e3 / us / ceiling)  # fmt: skip
                        table.append((gap, name, mb, budget_mb, layout, evict, us, base - us))
    backend.EVICT_LAST = False
    print(f"\ncopy {ceiling:.0f} GB/s, L2 {l2 / 2**20:.0f} MB; consumer us after an idle gap (saved: against none)")
    print(f"{'gap':>4} {'consumer':>15} {'MB':>6} {'budget':>6} {'layout':>6} {'evl':>3} {'us':>7} {'saved':>6}")
    for gap, name, mb, b, layout, evict, us, saved in table:
        print(f"{gap:4.0f} {name:>15} {mb:6.1f} {b:6d} {layout:>6} {int(evict):3d} {us:7.1f} {saved:6.1f}")


if __name__ == "__main__":
    main()

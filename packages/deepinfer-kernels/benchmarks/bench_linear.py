"""Microbenchmark of ``linear`` (dense y = x W^T) on the GPU at V4.1-Flash shapes.

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_linear.py [--quick]

Measures the ceilings in the same run (copy GB/s, bf16 matmul TFLOP/s at 8192^3), then for each projection and
M in decode (1, 8, 64, 256) and prefill (4096, 8192) sizes: the reference (16-row tiles, one F.linear each),
``cublas`` (one F.linear) and ``triton_fixed`` (batch-invariant). Prints TFLOP/s, GB/s (bytes of x, W and y
once) and % of the ceilings; appends JSON lines to benchmarks/results/linear.jsonl; a short table last.

``--decode``: the decode-size projections of V4 / V4.1 at 1, 2 and 8 rows, replayed from CUDA graphs (a step's
view: no launch overhead), ``triton_skinny`` (the default backend there) against cuBLAS, with GB/s of the weight.

``--stream``: the wide decode projections (16-315 MB weights: q up-projections, output projections, the shared
expert's down projection, V4.1's Engram value projection) at 1 and 8 rows: ``triton_skinny``'s
weight-stream tilings (``STREAM_TILINGS``) against cuBLAS, CUDA graphs of calls on rotating weight copies (each call
streams its weight from HBM, as in a decode step), GB/s of the weight and % of copy; the best tiling per shape last.

``--many``: ``linear_many`` at 1-256 rows on the sets of projections a V4 / V4.1 decode step makes of one input (an
attention layer's, a shared expert's gate and up), CUDA graphs: one launch (``triton_skinny``) against one ``linear``
per weight (the ``loop`` backend: skinny / cuBLAS each), GB/s of all the weights and, for the sets it serves from 16
rows on, TFLOP/s and the best of ``MID_TILINGS`` (the mid-size tiling's candidates, K split by the backend's rule).

``--many-cold``: the same sets at 1 and 8 rows as a decode step streams them, over rotating copies of each set (more
than the L2 holds, so every call reads its weights from HBM): the backend's ``decode_tiling`` against the narrow
tilings of ``NARROW_TILINGS`` (the first is the single ``linear``'s, which ``linear_many`` used before session 23).
``--decode-cold``: likewise one narrow weight (the routers' gate GEMVs and ``DECODE_SHAPES``) against
``NARROW_ONE_TILINGS`` and cuBLAS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, graph_us, matmul_ceiling_tflops  # noqa: E402
from deepinfer_kernels.ops.linear.cublas import linear_cublas  # noqa: E402
from deepinfer_kernels.ops.linear.reference import linear_ref  # noqa: E402
from deepinfer_kernels.ops.linear.triton import linear_triton_fixed  # noqa: E402
from deepinfer_kernels.ops.linear.triton_skinny import Tiling, even_k_split, linear_skinny, serves  # noqa: E402
from deepinfer_kernels.ops.linear_many.reference import linear_many_loop  # noqa: E402
from deepinfer_kernels.ops.linear_many.triton import k_splits, linear_many_skinny  # noqa: E402
from deepinfer_kernels.ops.linear_many.triton import serves as many_serves  # noqa: E402

# (name, N, K, activation dtype): V4.1-Flash dense projections (hidden 5120) in bf16, router and head in fp32
SHAPES = [
    ("wq_a", 1280, 5120, torch.bfloat16),
    ("wq_b", 32768, 1280, torch.bfloat16),
    ("wkv", 512, 5120, torch.bfloat16),
    ("wo_b", 5120, 8192, torch.bfloat16),
    ("shared_w13", 4608, 5120, torch.bfloat16),
    ("head_fp32", 129280, 5120, torch.float32),
]
M_SIZES = [1, 8, 64, 256, 4096, 8192]
IMPLS = {"reference": linear_ref, "cublas": linear_cublas, "triton_fixed": linear_triton_fixed}


def bench_case(rec, ceil, name, m, n, k, dtype) -> dict:
    x = torch.randn(m, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    e = x.element_size()
    flops, nbytes = 2 * m * n * k, (m * k + n * k + m * n) * e
    row = {"shape": name, "M": m}
    for impl, fn in IMPLS.items():
        if impl == "reference" and m > 256:  # M / 16 launches: minutes at prefill sizes, and nothing to learn
            row[impl + "_us"] = float("nan")
            continue
        ms = bench_ms(fn, x, w)
        tf, gbs = flops / ms / 1e9, nbytes / ms / 1e6
        row[impl + "_us"] = ms * 1e3
        pct = {"pct_bf16_peak": 100 * tf / ceil["bf16_TFLOPs"], "pct_copy": 100 * gbs / ceil["copy_GBps"]}
        rec.add(
            kind="op", shape=name, M=m, N=n, K=k, dtype=str(dtype), impl=impl, us=ms * 1e3, TFLOPs=tf, GBps=gbs, **pct
        )
    best = row["triton_fixed_us"] / 1e3
    row["fixed_TFLOPs"] = flops / best / 1e9
    row["fixed_%bf16"] = 100 * row["fixed_TFLOPs"] / ceil["bf16_TFLOPs"]
    row["fixed_%copy"] = 100 * nbytes / best / 1e6 / ceil["copy_GBps"]
    return row


# (name, N, K, fp32 output): decode projections of V4 (hidden 4096) and V4.1 (5120) served by triton_skinny
DECODE_SHAPES = [
    ("v4 wq_a", 1024, 4096, False),
    ("v4 wkv", 512, 4096, False),
    ("v4 compressor", 1024, 4096, True),
    ("v4 index compressor", 256, 4096, True),
    ("v4 index weights", 64, 4096, False),
    ("v4 csa compressor", 2048, 4096, True),
    ("v41 wq_a", 1280, 5120, False),
    ("v41 wkv", 512, 5120, False),
    ("v41 index compressor", 384, 5120, True),
    ("v41 compressor", 2304, 5120, True),
]
# the routers' gate GEMVs (fp32 logits): alone on a MoE layer's critical path, before the router and the experts
GATE_SHAPES = [("v4 gate", 256, 4096, True), ("v41 gate", 384, 5120, True)]
# (block_n, block_k, k_split, warps, stages) for one narrow weight at 1-8 rows, cold; the first is narrow_tiling's
NARROW_ONE_TILINGS = [
    (32, 128, 512, 4, 4), (32, 128, 256, 4, 4), (16, 128, 512, 4, 4), (16, 128, 256, 4, 4), (32, 128, 1024, 4, 3),
    (32, 64, 512, 4, 4), (64, 128, 512, 4, 4), (32, 128, 512, 8, 4), (32, 128, 512, 2, 4),
]  # fmt: skip


def _cold_tilings(rec, ceil, where: str, k: int, tilings, call, want: list, copies, nbytes: int, **meta) -> list:
    """``call(weights, cfg)`` (one output or a list) for each (block_n, block_k, k_split, warps, stages) of
    ``tilings`` over rotating ``copies`` of the weights, after checking its outputs against ``want`` (relative error
    at most 1e-2; a tiling that fails to launch or to match is reported and skipped). Records each; returns
    [(us, label, % of copy)]."""
    cells = []
    for i, (bn, bk, ks, warps, stages) in enumerate(tilings):
        cfg = Tiling(bn, bk, *even_k_split(k, ks, bk), warps, stages)
        try:
            got = call(copies[0], cfg)
        except Exception as exc:  # a tiling past the SM's resources: say so, go on
            print(f"  {where} {cfg}: {type(exc).__name__} (skipped)")
            continue
        got = got if isinstance(got, (list, tuple)) else [got]
        err = max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want))
        if err > 1e-2:
            print(f"  {where} {cfg}: rel err {err:.1e} against the reference (skipped)")
            continue
        us = _rotating_us(lambda ws, cfg=cfg: call(ws, cfg), copies)
        label = f"bn{bn} bk{bk} ks{cfg.k_split}x{cfg.split} w{warps} s{stages}"
        pct = _pct_copy(nbytes, us, ceil)
        rec.add(**meta, candidate=i, tiling=label, us=us, pct_copy=pct)
        cells.append((us, label, pct))
    return cells


def _pct_copy(nbytes: int, us: float, ceil) -> float:
    return 100 * nbytes / us / 1e3 / ceil["copy_GBps"]


def _report_cold(rec, ceil, where: str, nbytes: int, default: float, cells: list, tail: str, **meta) -> None:
    """Record the default dispatch's ``default`` us (``meta``: the row's keys), print it against the copy ceiling
    with ``tail``, then the four fastest of ``cells`` (``_cold_tilings``)."""
    rec.add(**meta, candidate="default", us=default)
    pct = _pct_copy(nbytes, default, ceil)
    print(f"  {where} {nbytes / 2**20:5.1f} MiB  default {default:6.2f} us ({pct:4.1f}%){tail}")
    for us, label, pct in sorted(cells)[:4]:
        print(f"      {label:28s} {us:6.2f} us {pct:5.1f}%")


def decode_cold_table(rec, ceil) -> None:
    """One narrow weight at 1 / 8 rows over rotating copies (each call from HBM, as in a step): the default
    dispatch against ``NARROW_ONE_TILINGS``; the four fastest per shape."""
    print("\n== one narrow decode projection, cold (rotating copies), CUDA graphs (us; % of copy)")
    for name, n, k, f32 in GATE_SHAPES + DECODE_SHAPES:
        nbytes = n * k * 2
        copies = [
            (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(max(2, (1 << 29) // nbytes))
        ]
        out = torch.float32 if f32 else None
        for m in (1, 8):
            if not serves(m, n):
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = linear_cublas(x, copies[0], out).float()
            default = _rotating_us(lambda w, x=x, out=out: linear_skinny(x, w, out), copies)
            cublas = _rotating_us(lambda w, x=x, out=out: linear_cublas(x, w, out), copies)
            cells = _cold_tilings(
                rec, ceil, f"{name} M={m}", k, NARROW_ONE_TILINGS,
                lambda w, cfg, x=x, out=out: linear_skinny(x, w, out, cfg=cfg), [ref], copies, nbytes,
                kind="decode_cold", shape=name, N=n, K=k, M=m,
            )  # fmt: skip
            _report_cold(
                rec, ceil, f"{name:20s} M={m}", nbytes, default, cells, f"  cuBLAS {cublas:6.2f}",
                kind="decode_cold", shape=name, N=n, K=k, M=m, cublas_us=cublas,
            )  # fmt: skip
        del copies


def decode_table(rec, ceil) -> None:
    print("\n== decode projections, CUDA graphs (us; GB/s and % of copy for the weight stream)")
    cols = ["shape", "M", "cublas_us", "skinny_us", "speedup", "skinny_GBps", "skinny_%copy"]
    print("  ".join(f"{c:>20}" for c in cols))
    for name, n, k, f32 in DECODE_SHAPES:
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        for m in (1, 2, 8):
            if not serves(m, n):
                continue
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.float32 if f32 else None
            cub = graph_us(lambda x=x, w=w, out=out: linear_cublas(x, w, out))
            ski = graph_us(lambda x=x, w=w, out=out: linear_skinny(x, w, out))
            gbs = n * k * 2 / ski / 1e3
            row = {"shape": name, "M": m, "cublas_us": cub, "skinny_us": ski, "speedup": cub / ski, "skinny_GBps": gbs,
                   "skinny_%copy": 100 * gbs / ceil["copy_GBps"]}  # fmt: skip
            rec.add(kind="decode", N=n, K=k, fp32_out=f32, **row)
            print("  ".join(f"{row[c]:>20.4g}" if isinstance(row[c], float) else f"{row[c]:>20}" for c in cols))


# (name, N, K): the wide decode projections
STREAM_SHAPES = [
    ("v4 wq_b", 32768, 1024),
    ("v4 wo_b", 4096, 8192),
    ("v4 shared w2", 4096, 2048),
    ("v4 index wq_b", 8192, 1024),
    ("v41 wq_b", 32768, 1280),
    ("v41 wo_b", 5120, 8192),
    ("v41 shared w2", 5120, 2304),
    ("v41 index wq_b", 4096, 1280),
    ("v41 engram wkv", 25600, 6144),
]
# (block_n, block_k, K split target, warps, stages); the K split is evened out over whole BLOCK_K steps
STREAM_TILINGS = [
    (32, 128, 512, 4, 4), (64, 128, 1024, 4, 4), (64, 128, 2048, 4, 4), (64, 256, 1024, 4, 3), (128, 128, 1024, 4, 3),
    (128, 128, 1024, 8, 4), (128, 128, 2048, 8, 4), (128, 128, 2048, 4, 3), (64, 128, 4096, 4, 4),
]  # fmt: skip


def _tiling(bn: int, bk: int, ks: int, warps: int, stages: int, k: int) -> Tiling:
    return Tiling(bn, bk, *even_k_split(k, ks, bk), warps, stages)


def _rotating_us(fn, copies) -> float:
    """graph_us of fn(weight) with each captured call on the next weight copy (so each streams from HBM)."""
    turn = iter(range(1 << 30))
    return graph_us(lambda: fn(copies[next(turn) % len(copies)]))


def stream_case(rec, ceil, tilings, name: str, n: int, k: int, m: int, copies) -> tuple:
    """One shape at m rows: cuBLAS, the default dispatch and every tiling; returns (cuBLAS, default, best) us."""
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = linear_cublas(x, copies[0]).float()
    results = [("cuBLAS", _rotating_us(lambda w: linear_cublas(x, w), copies))]
    results.append(
        ("default" if serves(m, n, k) else "default (cuBLAS)", _rotating_us(lambda w: linear_skinny(x, w), copies))
    )
    for t in tilings:
        tiling = _tiling(*t, k)
        label = (
            f"bn{tiling.block_n} bk{tiling.block_k} ks{tiling.k_split}x{tiling.split} w{tiling.warps} s{tiling.stages}"
        )
        err = ((linear_skinny(x, copies[0], cfg=tiling).float() - ref).norm() / ref.norm()).item()
        if err > 1e-2:
            print(f"  {name} M={m} {label}: rel err {err:.1e} against cuBLAS (skipped)")
            continue
        results.append((label, _rotating_us(lambda w, t=tiling: linear_skinny(x, w, cfg=t), copies)))
    nbytes = n * k * 2
    for label, us in results:
        gbs = nbytes / us / 1e3
        pct = 100 * gbs / ceil["copy_GBps"]
        rec.add(kind="stream", shape=name, N=n, K=k, M=m, impl=label, us=us, GBps=gbs, pct_copy=pct)
        print(f"  {name:20s} M={m} {label:34s} {us:7.2f} us {gbs:6.0f} GB/s {pct:5.1f}%")
    best = min(results[2:], key=lambda r: r[1]) if len(results) > 2 else results[1]
    return results[0][1], results[1][1], best


def stream_table(rec, ceil, tilings) -> None:
    print("\n== wide decode projections, CUDA graphs over rotating weight copies (us; GB/s of the weight)")
    rows = []
    for name, n, k in STREAM_SHAPES:
        nbytes = n * k * 2
        copies = [
            (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(max(2, (1 << 29) // nbytes))
        ]
        rows += [(name, m, nbytes, *stream_case(rec, ceil, tilings, name, n, k, m, copies)) for m in (1, 8)]
        del copies
    print("\n== best per shape (us): cuBLAS, the default dispatch, the best tiling (GB/s of the weight)")
    for name, m, nbytes, base, default, (label, us) in rows:
        print(
            f"  {name:20s} M={m} cuBLAS {base:7.2f}  default {default:7.2f} ({base / default:4.2f}x)  "
            f"best {label:34s} {us:7.2f} ({nbytes / us / 1e3:.0f} GB/s)"
        )


# (name, K, [(N, fp32 output)]): the projections of one normed input in a decode step
MANY_SETS = [
    ("v4 csa attention", 4096, [(1024, 0), (512, 0), (1024, 1), (1024, 1), (64, 0), (256, 1), (256, 1)]),
    ("v4 hca attention", 4096, [(1024, 0), (512, 0), (512, 1), (512, 1)]),
    ("v4 swa attention", 4096, [(1024, 0), (512, 0)]),
    ("v4 shared gate+up", 4096, [(2048, 1), (2048, 1)]),
    ("v41 source attention", 5120, [(1280, 0), (512, 0), (512, 1), (512, 1), (32, 0)]),
    ("v41 swa attention", 5120, [(1280, 0), (512, 0)]),
    ("v41 shared gate+up", 5120, [(2304, 1), (2304, 1)]),
]


# (block_m, block_n, block_k, warps, stages) tried at 16-256 rows
MID_TILINGS = [(64, 64, 128, 4, 3), (64, 32, 128, 4, 4), (128, 64, 64, 4, 4), (128, 64, 128, 4, 3), (64, 64, 64, 4, 4)]


def many_table(rec, ceil) -> None:
    print("\n== linear_many, CUDA graphs (us; GB/s and % of copy for all the weights, TFLOP/s)")
    cols = ["set", "M", "loop_us", "many_us", "speedup", "many_GBps", "many_%copy", "TFLOPs", "best_tiling", "best_us"]
    print("  ".join(f"{c:>14}" for c in cols))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, k, parts in MANY_SETS:
        ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for n, _ in parts]
        ns = [n for n, _ in parts]
        dts = [torch.float32 if f else None for _, f in parts]
        nbytes = sum(w.numel() for w in ws) * 2
        for m in (1, 2, 8, 16, 64, 128, 256):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            loop = graph_us(lambda x=x, ws=ws, dts=dts: linear_many_loop(x, ws, dts))
            many = graph_us(lambda x=x, ws=ws, dts=dts: linear_many_skinny(x, ws, dts))
            best = ("-", many)
            if m > 8 and many_serves(x, ws, dts):
                for bm, bn, bk, warps, stages in MID_TILINGS:
                    tiles = -(-m // bm) * sum(-(-n // bn) for n in ns)
                    cfg = Tiling(bn, bk, *k_splits(tiles, k, sms, bk), warps, stages, block_m=bm)
                    us = graph_us(lambda x=x, ws=ws, dts=dts, cfg=cfg: linear_many_skinny(x, ws, dts, cfg=cfg))
                    if us < best[1]:
                        best = (f"{bm}x{bn}x{bk}/{cfg.split}w{warps}s{stages}", us)
            gbs = nbytes / many / 1e3
            row = {"set": name, "M": m, "loop_us": loop, "many_us": many, "speedup": loop / many, "many_GBps": gbs,
                   "many_%copy": 100 * gbs / ceil["copy_GBps"], "TFLOPs": 2 * m * nbytes / 2 / many / 1e6,
                   "best_tiling": best[0], "best_us": best[1]}  # fmt: skip
            rec.add(kind="many", K=k, N=ns, **row)
            print("  ".join(f"{row[c]:>14.4g}" if isinstance(row[c], float) else f"{row[c]:>14}" for c in cols))


# (block_n, block_k, k_split, warps, stages) tried at 1-8 rows, cold; the first is linear's narrow_tiling, the third
# linear_many's decode_tiling since session 23
NARROW_TILINGS = [
    (32, 128, 512, 4, 4), (32, 128, 1024, 4, 4), (32, 128, 1024, 4, 3), (32, 128, 2048, 4, 4), (32, 128, 512, 4, 2),
    (32, 64, 512, 4, 4), (64, 128, 1024, 4, 3), (64, 128, 512, 4, 3), (16, 128, 1024, 4, 4), (16, 128, 2048, 4, 4),
    (32, 256, 1024, 4, 2), (32, 128, 1024, 8, 4),
]  # fmt: skip


def many_cold_table(rec, ceil) -> None:
    print("\n== linear_many at decode rows, cold (rotating copies of each set), CUDA graphs (us; % of copy)")
    for name, k, parts in MANY_SETS:
        ns = [n for n, _ in parts]
        dts = [torch.float32 if f else None for _, f in parts]
        nbytes = sum(ns) * k * 2
        sets = [
            [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for n in ns]
            for _ in range(max(2, (1 << 29) // nbytes))
        ]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            want = linear_many_loop(x, sets[0], dts)
            default = _rotating_us(lambda ws, x=x, dts=dts: linear_many_skinny(x, ws, dts), sets)
            cells = _cold_tilings(
                rec, ceil, f"{name} M={m}", k, NARROW_TILINGS,
                lambda ws, cfg, x=x, dts=dts: linear_many_skinny(x, ws, dts, cfg=cfg), want, sets, nbytes,
                kind="many_cold", set=name, M=m,
            )  # fmt: skip
            best = min(cells)
            _report_cold(
                rec, ceil, f"{name:20s} M={m}", nbytes, default, cells,
                f"  best {best[1]:28s} {best[0]:6.2f} us ({best[2]:4.1f}%)", kind="many_cold", set=name, M=m,
            )  # fmt: skip
        del sets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three shapes, M in (1, 64, 4096)")
    ap.add_argument("--decode", action="store_true", help="only the decode projections (triton_skinny vs cuBLAS)")
    ap.add_argument("--many", action="store_true", help="only linear_many's decode sets (one launch vs a loop)")
    ap.add_argument("--stream", action="store_true", help="only the wide decode projections (weight-stream tilings)")
    ap.add_argument("--many-cold", action="store_true", help="linear_many's sets at 1 / 8 rows, cold, narrow tilings")
    ap.add_argument("--decode-cold", action="store_true", help="one narrow weight at 1 / 8 rows, cold, tilings")
    args = ap.parse_args()
    shapes = SHAPES[::2] if args.quick else SHAPES
    m_sizes = [1, 64, 4096] if args.quick else M_SIZES
    ceil = {"copy_GBps": copy_ceiling_gbs(), "bf16_TFLOPs": matmul_ceiling_tflops()}
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    rec = Recorder("linear")
    rec.add(kind="ceilings", **ceil)
    if args.stream:
        stream_table(rec, ceil, STREAM_TILINGS)
        return
    tables = [(args.decode, decode_table), (args.many, many_table), (args.decode_cold, decode_cold_table),
              (args.many_cold, many_cold_table)]  # fmt: skip
    if any(asked for asked, _ in tables):  # only the decode-size tables asked for
        for asked, table in tables:
            if asked:
                table(rec, ceil)
        return
    table = [bench_case(rec, ceil, name, m, n, k, dt) for name, n, k, dt in shapes for m in m_sizes]
    print("\n== linear (us; TFLOP/s and % of ceilings for triton_fixed)")
    cols = ["shape", "M", "reference_us", "cublas_us", "triton_fixed_us", "fixed_TFLOPs", "fixed_%bf16", "fixed_%copy"]
    print("  ".join(f"{c:>15}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>15.4g}" if isinstance(r[c], float) else f"{r[c]:>15}" for c in cols))


if __name__ == "__main__":
    main()

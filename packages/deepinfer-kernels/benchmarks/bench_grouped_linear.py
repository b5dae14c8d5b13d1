"""Microbenchmark of ``grouped_linear`` (V4's ``wo_a``: G = 8 groups, Din = 4096 -> Dout = 1024, bf16) on the GPU.

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_grouped_linear.py

Measures the ceilings in the same run (copy GB/s, bf16 matmul TFLOP/s at 8192^3), then for T in decode (1, 8, 64)
and prefill (4096) sizes: the reference (G x ceil(T / 16) F.linear launches), ``cublas`` (one batched GEMM) and
``triton_fixed`` (batch-invariant, one grouped launch + the split-K sum). Prints TFLOP/s, GB/s (bytes of x, W and
y once), % of the ceilings and the speed-up over the reference; ``wall_us`` is the host wall time per call of 100
back-to-back calls. Appends JSON lines to benchmarks/results/bench_grouped_linear.jsonl; a short table last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, matmul_ceiling_tflops, wall_us  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.cublas import grouped_linear_cublas  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.reference import grouped_linear_ref  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.triton import grouped_linear_triton_fixed  # noqa: E402

G, DIN, DOUT = 8, 4096, 1024
T_SIZES = [1, 8, 64, 4096]
IMPLS = {"reference": grouped_linear_ref, "cublas": grouped_linear_cublas, "triton_fixed": grouped_linear_triton_fixed}


def main() -> None:
    ceil = {"copy_GBps": copy_ceiling_gbs(), "bf16_TFLOPs": matmul_ceiling_tflops()}
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    rec = Recorder("bench_grouped_linear")
    rec.add(kind="ceilings", **ceil)
    w = (torch.randn(G * DOUT, DIN, device="cuda") / DIN**0.5).to(torch.bfloat16)
    table = []
    for t in T_SIZES:
        x = torch.randn(t, G, DIN, device="cuda").to(torch.bfloat16)
        flops, nbytes = 2 * t * G * DOUT * DIN, (t * G * DIN + G * DOUT * DIN + t * G * DOUT) * 2
        row = {"T": t}
        for impl, fn in IMPLS.items():
            ms = bench_ms(fn, x, w)
            tf, gbs = flops / ms / 1e9, nbytes / ms / 1e6
            row[impl + "_us"] = ms * 1e3
            row[impl + "_TFLOPs"] = tf
            row[impl + "_%copy"] = 100 * gbs / ceil["copy_GBps"]
            row[impl + "_wall_us"] = wall_us(fn, x, w, calls=10 if impl == "reference" and t > 64 else 100)
            rec.add(kind="op", T=t, G=G, Din=DIN, Dout=DOUT, impl=impl, us=ms * 1e3, TFLOPs=tf, GBps=gbs,
                    pct_bf16_peak=100 * tf / ceil["bf16_TFLOPs"], pct_copy=100 * gbs / ceil["copy_GBps"],
                    wall_us=row[impl + "_wall_us"])  # fmt: skip
        row["cublas_speedup"] = row["reference_us"] / row["cublas_us"]
        row["fixed_speedup"] = row["reference_us"] / row["triton_fixed_us"]
        row["fixed_%bf16"] = 100 * row["triton_fixed_TFLOPs"] / ceil["bf16_TFLOPs"]
        row["cublas_%bf16"] = 100 * row["cublas_TFLOPs"] / ceil["bf16_TFLOPs"]
        table.append(row)
    print("\n== grouped_linear G=8 4096->1024 bf16 (us; TFLOP/s, % of the bf16 matmul and copy ceilings)")
    cols = ["T", "reference_us", "cublas_us", "triton_fixed_us", "cublas_speedup", "fixed_speedup",
            "cublas_TFLOPs", "cublas_%bf16", "fixed_%bf16", "cublas_%copy", "triton_fixed_%copy",
            "reference_wall_us", "cublas_wall_us", "triton_fixed_wall_us"]  # fmt: skip
    print("  ".join(f"{c:>15}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>15.4g}" if isinstance(r[c], float) else f"{r[c]:>15}" for c in cols))


if __name__ == "__main__":
    main()

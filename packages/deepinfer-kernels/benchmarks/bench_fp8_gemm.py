"""Microbenchmark of fp8_gemm_nt (block-scaled FP8 GEMM) on the GPU at V4.1-Flash / V4-Flash shapes.

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_fp8_gemm.py [--quick] [--m 1,8,16]

Measures in the same run the ceilings (copy GB/s, bf16 matmul and fp8 ``_scaled_mm`` TFLOP/s at 8192^3), then
for each (N, K) and M in decode (1, 8, 16, 64, 256) and prefill (4096, 8192) sizes: the Triton backends
(``triton``: M-dependent tiles; ``triton_fixed``: batch-invariant), the registry's choice (``gluon``: the Gluon
decode kernel up to ``GLUON_MAX_M`` rows, then the bf16 routes where on: the in-kernel dequant kernel up to
``BF16_MAX_M``, dequantise + cuBLAS from ``DEQUANT_MM_FROM_M``, Triton's otherwise), the two bf16 routes on their
own (``bf16_kernel`` at 1 < M <= 1024, ``dequant_mm`` at M >= 256, each checked against ``triton_fixed``; the
activation scales are UE8M0 as the model's) and the torch peers
(dequantise A and B to bf16 + bf16 matmul, every call; bf16 matmul on pre-dequantised weights; ``_scaled_mm``
with row-wise scales, which is cheaper math than block scales); at decode sizes (M <= 64) also Triton and Gluon
after a 256 MB copy (cold L2, as a decode step runs them). Prints TFLOP/s, GB/s (bytes of A, B, scales and C once)
and % of the ceilings; appends JSON lines to benchmarks/results/fp8_gemm.jsonl; a short table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, bench_ms, cold_us, copy_ceiling_gbs, matmul_ceiling_tflops  # noqa: E402
from deepinfer_kernels.ops.fp8_gemm import gluon  # noqa: E402
from deepinfer_kernels.ops.fp8_gemm import triton as backend  # noqa: E402
from deepinfer_kernels.ops.fp8_gemm.dequant_mm import fp8_gemm_nt_dequant_mm  # noqa: E402
from deepinfer_kernels.ops.fp8_gemm.triton_bf16 import fp8_gemm_nt_triton_bf16  # noqa: E402
from deepinfer_kernels.ops.quant.reference import act_dequant_fp8_ref, fp8_block_dequantize_ref  # noqa: E402

# (name, N, K, block): V4.1-Flash MXFP8 dense projections (hidden 5120), two V4-Flash 128x128 ones
SHAPES = [
    ("v41.wq_a", 1280, 5120, 32),
    ("v41.wq_b", 32768, 1280, 32),
    ("v41.wkv", 512, 5120, 32),
    ("v41.wo_b", 5120, 8192, 32),
    ("v41.shared_w13", 4608, 5120, 32),
    ("v41.shared_w2", 5120, 2304, 32),
    ("v4.wq_b", 32768, 1024, 128),
]
M_SIZES = [1, 8, 16, 64, 256, 4096, 8192]


def fp8_scaled_mm_ceiling(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    ms = bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return 2 * n**3 / ms / 1e9


def operands(m, n, k, block):
    """fp8 codes from random normals; UE8M0 scales as the model's act_quant_fp8 and the checkpoints produce."""
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    sa = torch.randint(119, 127, (m, k // block), device="cuda", dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sb = torch.randint(118, 124, (-(-n // block), k // block), device="cuda", dtype=torch.uint8)
    return a, sa, b, sb.view(torch.float8_e8m0fnu)


def bench_case(rec, ceil, name, m, n, k, block, wdq) -> dict:
    """Time the Triton variants and the torch peers at one (M, N, K); returns the table row."""
    a, sa, b, sb = operands(m, n, k, block)
    ref = backend.fp8_gemm_nt_triton_fixed(a, sa, b, sb, block)  # also the compile / warm-up
    flops = 2 * m * n * k
    nbytes = m * k + n * k + m * n * 2 + sa.numel() + sb.numel()
    a_bf16 = act_dequant_fp8_ref(a, sa, block, torch.bfloat16)
    ones_a, ones_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    cands = {
        "triton": lambda: backend.fp8_gemm_nt_triton(a, sa, b, sb, block),
        "triton_fixed": lambda: backend.fp8_gemm_nt_triton_fixed(a, sa, b, sb, block),
        "gluon": lambda: gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block),
        "bf16_kernel": lambda: fp8_gemm_nt_triton_bf16(a, sa, b, sb, block),
        "dequant_mm": lambda: fp8_gemm_nt_dequant_mm(a, sa, b, sb, block),
        "torch_dequant_mm": lambda: (
            act_dequant_fp8_ref(a, sa, block, torch.bfloat16)
            @ fp8_block_dequantize_ref(b, sb, (block, block), torch.bfloat16).T
        ),
        "torch_bf16_mm": lambda: a_bf16 @ wdq.T,
        "scaled_mm_rowwise": lambda: torch._scaled_mm(
            a, b.t(), scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16
        ),
    }
    err = (backend.fp8_gemm_nt_triton(a, sa, b, sb, block).float() - ref.float()).norm() / ref.float().norm()
    err_g = (gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block).float() - ref.float()).norm() / ref.float().norm()
    row = {"shape": name, "M": m, "N": n, "K": k, "block": block, "triton_vs_fixed_rel": float(err),
           "gluon_vs_fixed_rel": float(err_g)}  # fmt: skip
    if not (1 < m <= 1024 and k % 64 == 0):
        del cands["bf16_kernel"]
    if m < 256:
        del cands["dequant_mm"]
    for cname in ("bf16_kernel", "dequant_mm"):
        row[cname + "_us"] = float("nan")
        if cname in cands:
            got = cands[cname]().float()
            row[cname + "_vs_fixed_rel"] = float((got - ref.float()).norm() / ref.float().norm())
    for cname, fn in cands.items():
        ms = bench_ms(fn)
        tf, gbs = flops / ms / 1e9, nbytes / ms / 1e6
        row[cname + "_us"] = ms * 1e3
        rec.add(kind="op", shape=name, M=m, N=n, K=k, block=block, impl=cname, us=ms * 1e3, TFLOPs=tf, GBps=gbs,
                pct_fp8_peak=100 * tf / ceil["fp8_TFLOPs"], pct_copy=100 * gbs / ceil["copy_GBps"])  # fmt: skip
    for cname in ("triton", "gluon"):  # decode sizes as a step sees them: weights cold in L2 (``cold_us``)
        row[cname + "_cold_us"] = cold_us(cands[cname], reps=5) if m <= 64 else float("nan")
    if m <= 64:
        row["%copy_cold"] = 100 * nbytes / min(row["triton_cold_us"], row["gluon_cold_us"]) / 1e3 / ceil["copy_GBps"]
    else:
        row["%copy_cold"] = float("nan")
    best = min(row["triton_us"], row["triton_fixed_us"], row["gluon_us"], row["bf16_kernel_us"], row["dequant_mm_us"])
    row["TFLOPs"] = flops / best / 1e6
    row["GBps"] = nbytes / best / 1e3
    row["%fp8"] = 100 * row["TFLOPs"] / ceil["fp8_TFLOPs"]
    row["%bf16"] = 100 * row["TFLOPs"] / ceil["bf16_TFLOPs"]  # the bf16 routes run bf16 MMAs
    row["%copy"] = 100 * row["GBps"] / ceil["copy_GBps"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three shapes, M in (1, 64, 4096)")
    ap.add_argument("--m", default="", help="comma-separated M sizes (default: all)")
    args = ap.parse_args()
    shapes = SHAPES[::3] if args.quick else SHAPES
    m_sizes = [1, 64, 4096] if args.quick else M_SIZES
    if args.m:
        m_sizes = [int(v) for v in args.m.split(",")]
    ceil = {
        "copy_GBps": copy_ceiling_gbs(),
        "bf16_TFLOPs": matmul_ceiling_tflops(),
        "fp8_TFLOPs": fp8_scaled_mm_ceiling(),
    }
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    rec = Recorder("fp8_gemm")
    rec.add(kind="ceilings", **ceil)
    table = []
    for name, n, k, block in shapes:
        wdq = fp8_block_dequantize_ref(*operands(1, n, k, block)[2:], (block, block), torch.bfloat16)
        for m in m_sizes:
            table.append(bench_case(rec, ceil, name, m, n, k, block, wdq))
    print("\n== fp8_gemm_nt (us; TFLOP/s, GB/s and % of ceilings for the fastest of ours)")
    cols = ["shape", "M", "triton_us", "triton_fixed_us", "gluon_us", "bf16_kernel_us", "dequant_mm_us",
            "triton_cold_us", "gluon_cold_us", "%copy_cold",
            "torch_dequant_mm_us", "torch_bf16_mm_us",
            "scaled_mm_rowwise_us", "TFLOPs", "%fp8", "%bf16", "GBps", "%copy"]  # fmt: skip
    print("  ".join(f"{c:>12}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>12.4g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))


if __name__ == "__main__":
    main()

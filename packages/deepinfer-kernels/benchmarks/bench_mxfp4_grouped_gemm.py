"""Microbenchmark of the MXFP4 expert GEMMs on the GPU at V4.1-Flash shapes (384 experts, hidden 5120, width
2304, top-6): gate/up with the fused clamped SwiGLU (N = 4608, K = 5120) and down (N = 5120, K = 2304).

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_mxfp4_grouped_gemm.py [--quick]

Ceilings in the same run (copy GB/s, bf16 matmul TFLOP/s), then for T tokens in decode (1, 8, 64, 256) and
prefill (4096, 8192) sizes: ``moe_permute``, the contiguous layout (all T; the Triton kernel, and the sm_90 Gluon
dispatch: 8-row ``mma.sync`` and 32-row wgmma tiles, the TMA kernel at prefill sizes), the gathered layout (T <= 256;
the Triton kernel and the Gluon one that dispatch picks on sm_90) and the torch peers: ``torch._grouped_mm`` and a
loop of bf16 matmuls over the hit experts, both with weights pre-dequantised to bf16 (what a bf16-weight engine
does), and, for T <= 64, dequantise-every-call + matmul. Bytes = weights of the experts hit
(0.5 + 1/32 byte per weight) + activations in and out; FLOPs = 2 R N K with R = T * 6 rows.
Appends JSON lines to benchmarks/results/mxfp4_grouped_gemm.jsonl; prints a short table last.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs, matmul_ceiling_tflops  # noqa: E402
from deepinfer_kernels.ops.moe_permute import moe_permute  # noqa: E402
from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as gluon_backend  # noqa: E402
from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as backend  # noqa: E402
from deepinfer_kernels.ops.quant.reference import mxfp4_dequantize_ref  # noqa: E402

E, D, INTER, TOP_K, LIMIT = 384, 5120, 2304, 6, 10.0


def weights(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randint(0, 256, (E, n, k // 2), generator=g, dtype=torch.uint8, device="cuda")
    s = torch.randint(118, 124, (E, n, k // 32), generator=g, dtype=torch.uint8, device="cuda")
    return w, s


def peer_loop(inp, offs, hit, rows, n, weight_of):
    """torch peer: one bf16 matmul per hit expert (``weight_of(e)``: its [n, k] bf16 weight)."""
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    for e in hit:
        out[offs[e] : offs[e + 1]] = inp[offs[e] : offs[e + 1]] @ weight_of(e).T
    return out


def bench_tokens(rec, ceil, t, w13, s13, w2, s2, w13b, w2b) -> list[dict]:
    """Both projections at T tokens: Triton layouts and torch peers; returns two table rows."""
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    experts = torch.rand(t, E, generator=g, device="cuda").argsort(1)[:, :TOP_K]
    rw = torch.rand(t, TOP_K, generator=g, device="cuda")
    xs, order, offsets = moe_permute(x, experts, E)
    rs = rw.flatten()[order]
    rows = t * TOP_K
    ids = experts.flatten()
    idx = torch.arange(rows, device="cuda") // TOP_K
    offs = offsets.tolist()
    hit = [e for e in range(E) if offs[e + 1] > offs[e]]
    h = backend.mxfp4_grouped_gemm_triton(xs, w13, s13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=rs)
    hg = backend.mxfp4_grouped_gemm_gather_triton(x, w13, s13, ids, row_index=idx, fuse_swiglu=True, swiglu_limit=LIMIT)
    grouped, gather = backend.mxfp4_grouped_gemm_triton, backend.mxfp4_grouped_gemm_gather_triton
    gather_gl = gluon_backend.mxfp4_grouped_gemm_gather_gluon
    grouped_gl = gluon_backend.mxfp4_grouped_gemm_gluon  # the sm_90 dispatch (prefill sizes: the TMA kernel)
    ends = offsets[1:].to(torch.int32)  # torch._grouped_mm's group ends (empty groups allowed)
    swiglu = dict(fuse_swiglu=True, swiglu_limit=LIMIT)
    cases = {
        "gate_up": (2 * INTER, D, INTER, {
            "contiguous": lambda: grouped(xs, w13, s13, offsets, **swiglu, row_scale=rs),
            "contiguous_gluon": lambda: grouped_gl(xs, w13, s13, offsets, **swiglu, row_scale=rs),
            "gather": lambda: gather(x, w13, s13, ids, row_index=idx, **swiglu, row_scale=rw.flatten()),
            "gather_gluon": lambda: gather_gl(x, w13, s13, ids, row_index=idx, **swiglu, row_scale=rw.flatten()),
            "torch_bf16_weights": lambda: peer_loop(xs, offs, hit, rows, 2 * INTER, lambda e: w13b[e]),
            "torch_grouped_mm_bf16": lambda: torch._grouped_mm(xs, w13b.transpose(-2, -1), offs=ends),
            "torch_dequant_mm": lambda: peer_loop(
                xs, offs, hit, rows, 2 * INTER, lambda e: mxfp4_dequantize_ref(w13[e], s13[e], torch.bfloat16)
            ),
        }),
        "down": (D, INTER, D, {
            "contiguous": lambda: grouped(h, w2, s2, offsets),
            "contiguous_gluon": lambda: grouped_gl(h, w2, s2, offsets),
            "gather": lambda: gather(hg, w2, s2, ids),
            "gather_gluon": lambda: gather_gl(hg, w2, s2, ids),
            "torch_bf16_weights": lambda: peer_loop(h, offs, hit, rows, D, lambda e: w2b[e]),
            "torch_grouped_mm_bf16": lambda: torch._grouped_mm(h, w2b.transpose(-2, -1), offs=ends),
            "torch_dequant_mm": lambda: peer_loop(
                h, offs, hit, rows, D, lambda e: mxfp4_dequantize_ref(w2[e], s2[e], torch.bfloat16)
            ),
        }),
    }  # fmt: skip
    table = []
    for proj, (n, k, n_out, cands) in cases.items():
        if t > 256:
            cands.pop("gather")  # a GEMV per row: decode only
            cands.pop("gather_gluon")
        if t > 64:
            cands.pop("torch_dequant_mm")  # hundreds of dequantisations per call
        if not hasattr(torch, "_grouped_mm"):
            cands.pop("torch_grouped_mm_bf16")
        flops = 2 * rows * n * k
        nbytes = len(hit) * n * k * (0.5 + 1 / 32) + rows * k * 2 + rows * n_out * 2
        row = {"proj": proj, "T": t, "experts_hit": len(hit)}
        for cname, fn in cands.items():
            try:
                ms = bench_ms(fn)
            except RuntimeError as exc:  # a peer this torch build does not run (e.g. empty groups): say so, go on
                print(f"{proj} T={t} {cname}: not run ({str(exc).splitlines()[0][:120]})", flush=True)
                continue
            tf, gbs = flops / ms / 1e9, nbytes / ms / 1e6
            row[cname + "_us"] = ms * 1e3
            rec.add(kind="op", proj=proj, T=t, rows=rows, experts_hit=len(hit), impl=cname, us=ms * 1e3,
                    TFLOPs=tf, GBps=gbs, pct_bf16_peak=100 * tf / ceil["bf16_TFLOPs"],
                    pct_copy=100 * gbs / ceil["copy_GBps"])  # fmt: skip
        best = min(row.get(c + "_us", 1e30) for c in ("contiguous", "contiguous_gluon", "gather", "gather_gluon"))
        row.update(TFLOPs=flops / best / 1e6, GBps=nbytes / best / 1e3)
        row["%bf16"] = 100 * row["TFLOPs"] / ceil["bf16_TFLOPs"]
        row["%copy"] = 100 * row["GBps"] / ceil["copy_GBps"]
        table.append(row)
    us = bench_ms(lambda: moe_permute(x, experts, E)) * 1e3
    rec.add(kind="op", proj="moe_permute", T=t, impl="torch", us=us)
    return table


def sweep_layout(rec, layout, t, w13, s13, w2, s2) -> None:
    """Time tile configurations of one layout at T tokens (gate/up + down) and print the best five."""
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    experts = torch.rand(t, E, generator=g, device="cuda").argsort(1)[:, :TOP_K]
    xs, order, offsets = moe_permute(x, experts, E)
    ids, rows = experts.flatten(), t * TOP_K
    idx = torch.arange(rows, device="cuda") // TOP_K
    h = torch.randn(rows, INTER, device="cuda").to(torch.bfloat16)
    if layout == "gather":
        cfg, second_name = backend.GATHER_CFG, "BLOCK_K"
        space = itertools.product([(16, 32), (32, 64), (64, 128)], [128, 256], [4, 8], [3])

        def run():
            backend.mxfp4_grouped_gemm_gather_triton(
                x, w13, s13, ids, row_index=idx, fuse_swiglu=True, swiglu_limit=LIMIT
            )
            backend.mxfp4_grouped_gemm_gather_triton(h, w2, s2, ids)
    else:
        cfg, second_name = backend.GROUPED_CFG, "BLOCK_M"
        space = itertools.product([(64, 128), (128, 128), (128, 256)], [64, 128], [4, 8], [3])

        def run():
            backend.mxfp4_grouped_gemm_triton(xs, w13, s13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT)
            backend.mxfp4_grouped_gemm_triton(h, w2, s2, offsets)

    saved = dict(cfg)
    results = []
    for (bns, bn), second, warps, stages in space:
        cfg.update(
            {"BLOCK_N_SWIGLU": bns, "BLOCK_N": bn, second_name: second, "num_warps": warps, "num_stages": stages}
        )
        try:
            us = bench_ms(run) * 1e3
        except Exception as exc:  # out of shared memory / registers: skip the point
            print(f"{layout} {(bns, bn, second, warps, stages)}: {type(exc).__name__}", flush=True)
            continue
        results.append((us, bns, bn, second, warps, stages))
        rec.add(kind="sweep", layout=layout, T=t, block_n_swiglu=bns, block_n=bn, second=second, warps=warps,
                stages=stages, us_gate_up_plus_down=us)  # fmt: skip
    cfg.update(saved)
    print(f"== sweep {layout} T={t} (BLOCK_N_SWIGLU, BLOCK_N, {second_name}, warps, stages); default {saved}")
    for r in sorted(results)[:5]:
        print(f"  {r[0]:9.1f} us  {r[1:]}")


def sweep(rec) -> None:
    w13, s13 = weights(2 * INTER, D, 1)
    w2, s2 = weights(D, INTER, 2)
    sweep_layout(rec, "gather", 8, w13, s13, w2, s2)
    sweep_layout(rec, "contiguous", 4096, w13, s13, w2, s2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T in (1, 64, 4096)")
    ap.add_argument("--sweep", action="store_true", help="only sweep the tile configurations")
    args = ap.parse_args()
    if args.sweep:
        sweep(Recorder("mxfp4_grouped_gemm"))
        return
    t_sizes = [1, 64, 4096] if args.quick else [1, 8, 64, 256, 4096, 8192]
    ceil = {"copy_GBps": copy_ceiling_gbs(), "bf16_TFLOPs": matmul_ceiling_tflops()}
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    rec = Recorder("mxfp4_grouped_gemm")
    rec.add(kind="ceilings", **ceil)
    w13, s13 = weights(2 * INTER, D, 1)
    w2, s2 = weights(D, INTER, 2)
    # pre-dequantised bf16 copies for the bf16-weight peer (27 GB)
    w13b = torch.stack([mxfp4_dequantize_ref(w13[e], s13[e], torch.bfloat16) for e in range(E)])
    w2b = torch.stack([mxfp4_dequantize_ref(w2[e], s2[e], torch.bfloat16) for e in range(E)])
    table = []
    for t in t_sizes:
        table += bench_tokens(rec, ceil, t, w13, s13, w2, s2, w13b, w2b)
    print("\n== MXFP4 expert GEMMs, V4.1-Flash (us; TFLOP/s, GB/s, % of ceilings for the fastest kernel)")
    cols = ["proj", "T", "experts_hit", "contiguous_us", "contiguous_gluon_us", "gather_us", "gather_gluon_us",
            "torch_grouped_mm_bf16_us", "torch_bf16_weights_us", "torch_dequant_mm_us",
            "TFLOPs", "%bf16", "GBps", "%copy"]  # fmt: skip
    print("  ".join(f"{c:>12}" for c in cols))
    for r in table:
        print("  ".join(f"{r[c]:>12.4g}" if isinstance(r.get(c), float) else f"{r.get(c, '-'):>12}" for c in cols))


if __name__ == "__main__":
    main()

"""The MXFP4 gathered (decode) expert GEMMs as a decode step sees them: replayed from CUDA graphs after a 256 MB copy
(cold L2, no host launch overhead: ``_bench_util.cold_us``), Triton (``tl.dot_scaled``) against Gluon (what dispatch
picks on sm_90), V4.1-Flash and V4-Flash shapes, 1 and 4 tokens (top-6, random routing).

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_mxfp4_gather_cold.py

% of copy counts the weight bytes of the distinct experts hit (0.5 + 1/32 byte a weight). Appends JSON lines to
benchmarks/results/mxfp4_gather_cold.jsonl; prints a short table last.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Recorder, cold_us, copy_ceiling_gbs  # noqa: E402
from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon, triton  # noqa: E402

SHAPES = {"v4.1": (384, 5120, 2304), "v4": (256, 4096, 2048)}  # experts, hidden, expert width
TOP_K, LIMIT = 6, 10.0


def main() -> None:
    ceil = copy_ceiling_gbs()
    print(f"copy {ceil:.0f} GB/s", flush=True)
    rec = Recorder("mxfp4_gather_cold")
    rec.add(kind="ceilings", copy_GBps=ceil)
    table = []
    for name, (e, d, inter) in SHAPES.items():
        w13 = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, device="cuda")
        s13 = torch.randint(118, 124, (e, 2 * inter, d // 32), dtype=torch.uint8, device="cuda")
        w2 = torch.randint(0, 256, (e, d, inter // 2), dtype=torch.uint8, device="cuda")
        s2 = torch.randint(118, 124, (e, d, inter // 32), dtype=torch.uint8, device="cuda")
        for t in (1, 4):
            x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
            ids = torch.rand(t, e, device="cuda").argsort(1)[:, :TOP_K].flatten()
            idx = torch.arange(TOP_K * t, device="cuda") // TOP_K
            rw = torch.rand(TOP_K * t, device="cuda")
            h = torch.randn(TOP_K * t, inter, device="cuda").to(torch.bfloat16)
            hit = len(set(ids.tolist()))
            gate_up = dict(row_index=idx, fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=rw)
            for proj, nbytes, args, kw in (
                ("gate_up", hit * 2 * inter * d * (0.5 + 1 / 32), (x, w13, s13, ids), gate_up),
                ("down", hit * d * inter * (0.5 + 1 / 32), (h, w2, s2, ids), {}),
            ):
                us = {
                    impl: cold_us(lambda fn=fn, a=args, k=kw: fn(*a, **k))
                    for impl, fn in (
                        ("triton", triton.mxfp4_grouped_gemm_gather_triton),
                        ("gluon", gluon.mxfp4_grouped_gemm_gather_gluon),
                    )
                }
                pct = {k: 100 * nbytes / v / 1e3 / ceil for k, v in us.items()}
                for impl in us:
                    rec.add(kind="op", model=name, T=t, proj=proj, impl=impl, us=us[impl], pct_copy=pct[impl])
                table.append(
                    f"{name:5} T={t} {proj:8} triton {us['triton']:7.1f} us ({pct['triton']:4.1f}% copy)  "
                    f"gluon {us['gluon']:7.1f} us ({pct['gluon']:4.1f}% copy)  x{us['triton'] / us['gluon']:.2f}"
                )
                print(table[-1], flush=True)
    print("== table")
    print("\n".join(table))


if __name__ == "__main__":
    main()

"""The MXFP4 expert GEMMs as a decode step sees them: replayed from CUDA graphs after a 256 MB copy (cold L2, no
host launch overhead: ``_bench_util.cold_us``), Triton (``tl.dot_scaled``) against Gluon (what dispatch picks on
sm_90), V4.1-Flash and V4-Flash shapes, top-6 random routing:

* the gathered layout (``mxfp4_grouped_gemm_gather``) at 1 and 4 tokens;
* the sorted layout (``mxfp4_grouped_gemm`` after ``moe_permute``; the tile schedules are inside the timed call) at
  8, 64 and 256 tokens, the decode batches that take it, and at 256 tokens routed over 90 experts ("256/90": ~17
  rows an expert, as the model slice's random routers give) and 1024 tokens (~16): the wgmma kernel's experts.

Run from the repository root:  python packages/deepinfer-kernels/benchmarks/bench_mxfp4_gather_cold.py
    [--gather-tokens 1,4] [--sorted-tokens 8,64,256,256/90,1024] [--models v4.1,v4]
    [--set deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon.SORTED_CFG.BLOCK_N=32]   (a tiling: tuning_overrides)

% of copy counts the weight bytes of the distinct experts hit (0.5 + 1/32 byte a weight). Appends JSON lines to
benchmarks/results/mxfp4_gather_cold.jsonl; prints a short table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # tuning_overrides (repository root)
from _bench_util import Recorder, cold_us, copy_ceiling_gbs  # noqa: E402
from deepinfer_kernels.ops.moe_permute import moe_permute  # noqa: E402
from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon, triton  # noqa: E402
from tuning_overrides import apply_overrides  # noqa: E402

SHAPES = {"v4.1": (384, 5120, 2304), "v4": (256, 4096, 2048)}  # experts, hidden, expert width
TOP_K, LIMIT = 6, 10.0
IMPLS = {
    "gather": (triton.mxfp4_grouped_gemm_gather_triton, gluon.mxfp4_grouped_gemm_gather_gluon),
    "sorted": (triton.mxfp4_grouped_gemm_triton, gluon.mxfp4_grouped_gemm_gluon),
}


def _cases(layout, t, e, d, inter, weights, hot=None):
    """(proj, weight bytes read, args, kwargs) of the gate/up and down calls of t tokens in ``layout`` (routed
    over the first ``hot`` experts when given)."""
    w13, s13, w2, s2 = weights
    x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
    experts = torch.rand(t, e, device="cuda").argsort(1)[:, :TOP_K] % (hot or e)
    rw = torch.rand(t, TOP_K, device="cuda")
    h = torch.randn(TOP_K * t, inter, device="cuda").to(torch.bfloat16)
    hit = len(set(experts.flatten().tolist()))
    up_bytes, down_bytes = hit * 2 * inter * d * (0.5 + 1 / 32), hit * d * inter * (0.5 + 1 / 32)
    if layout == "gather":
        ids = experts.flatten()
        idx = torch.arange(TOP_K * t, device="cuda") // TOP_K
        kw = dict(row_index=idx, fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=rw.flatten())
        return [("gate_up", up_bytes, (x, w13, s13, ids), kw), ("down", down_bytes, (h, w2, s2, ids), {})]
    xs, order, offsets = moe_permute(x, experts, e)
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=rw.flatten()[order])
    return [("gate_up", up_bytes, (xs, w13, s13, offsets), kw), ("down", down_bytes, (h, w2, s2, offsets), {})]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gather-tokens", default="1,4")
    ap.add_argument("--sorted-tokens", default="8,64,256,256/90,1024", help="T or T/experts hit")
    ap.add_argument("--models", default="v4.1,v4")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE", help="tuning_overrides")
    args = ap.parse_args()
    apply_overrides(args.set)
    ceil = copy_ceiling_gbs()
    print(f"copy {ceil:.0f} GB/s; settings {args.set}", flush=True)
    rec = Recorder("mxfp4_gather_cold")
    rec.add(kind="ceilings", copy_GBps=ceil, settings=args.set)
    table = []
    for name in args.models.split(","):
        e, d, inter = SHAPES[name]
        w13 = torch.randint(0, 256, (e, 2 * inter, d // 2), dtype=torch.uint8, device="cuda")
        s13 = torch.randint(118, 124, (e, 2 * inter, d // 32), dtype=torch.uint8, device="cuda")
        w2 = torch.randint(0, 256, (e, d, inter // 2), dtype=torch.uint8, device="cuda")
        s2 = torch.randint(118, 124, (e, d, inter // 32), dtype=torch.uint8, device="cuda")
        for layout, tokens in (("gather", args.gather_tokens), ("sorted", args.sorted_tokens)):
            for spec in [v for v in tokens.split(",") if v]:
                t, _, hot = spec.partition("/")
                t, hot = int(t), int(hot) if hot else None
                for proj, nbytes, fargs, kw in _cases(layout, t, e, d, inter, (w13, s13, w2, s2), hot):
                    us = {
                        impl: cold_us(lambda fn=fn, a=fargs, k=kw: fn(*a, **k))
                        for impl, fn in zip(("triton", "gluon"), IMPLS[layout])
                    }
                    pct = {k: 100 * nbytes / v / 1e3 / ceil for k, v in us.items()}
                    for impl in us:
                        rec.add(kind="op", model=name, layout=layout, T=t, experts_hit=hot or e, proj=proj, impl=impl,
                                us=us[impl], pct_copy=pct[impl])  # fmt: skip
                    table.append(
                        f"{name:5} {layout:6} T={spec:<7} {proj:8} "
                        + "  ".join(f"{k} {us[k]:8.1f} us ({pct[k]:4.1f}% copy)" for k in us)
                        + f"  x{us['triton'] / us['gluon']:.2f}"
                    )
                    print(table[-1], flush=True)
    print("== table")
    print("\n".join(table))


if __name__ == "__main__":
    main()

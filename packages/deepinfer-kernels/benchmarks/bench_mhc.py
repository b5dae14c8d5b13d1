"""mHC microbenchmark (CUDA): one same-site sublayer's mHC work (coefficients + collapse + expand around an
identity sublayer) with the Triton backends vs the plain-torch references, bf16 streams, n = 4, at the
V4-Flash (d = 4096) and V4.1-Flash (d = 5120) widths, as GB/s and % of the device-to-device copy ceiling
measured in the same run. The Triton rows also give each op's own time; for decode sizes the whole sublayer is
timed again as one CUDA graph replay (``graph_us``), i.e. without the Python launch overhead, with the
batch-invariant coefficients and with the default ``triton_adaptive`` ones (``adaptive_graph_us``: its tilings
up to 64 tokens). A V4 site's chain before its sublayer is timed the same way both ways: coefficients then
collapse + RMSNorm (``input_chain_graph_us``), and the sublayer input from the pre rows alone
(``mhc_pre_collapse_rms_norm``, ``pre_input_graph_us``), which the model uses up to 64 tokens while post / comb
are made beside the sublayer. A V4.1 site boundary (the expand, then the next site's input: collapse + RMSNorm
of the new streams with the site's own pre) is timed both ways: ``boundary_us`` as two kernels reading the streams
back, ``boundary_fused_us`` with ``mhc_expand_collapse`` handing the collapse over and ``rms_norm`` on it.

Bytes counted (the floor of the sublayer): coefficients read x and fn and write pre/post/comb; collapse reads
x and pre and writes u; expand reads x, y (= u), post and comb and writes the new streams.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_mhc.py``.
Writes ``benchmarks/results/bench_mhc.jsonl``.
"""

import torch
import triton.testing
from _bench_util import Recorder, bench_ms, copy_ceiling_gbs
from deepinfer_kernels.ops.mhc.reference import mhc_coefficients_ref, mhc_collapse_ref, mhc_expand_ref
from deepinfer_kernels.ops.mhc.triton import (
    mhc_coefficients_triton,
    mhc_coefficients_triton_adaptive,
    mhc_collapse_rms_norm_triton,
    mhc_collapse_triton,
    mhc_expand_collapse_triton,
    mhc_expand_triton,
    mhc_pre_collapse_rms_norm_triton_adaptive,
)
from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton

N = 4
EPS = (1e-6, 1e-6, 20)  # norm_eps, hc_eps, sinkhorn_iters
GRAPH_MAX_T = 256


def sublayer(coefficients, collapse, expand, x, fn, base, scale):
    pre, post, comb = coefficients(x, fn, base, scale, *EPS)
    return expand(x, collapse(x, pre), post, comb)  # identity stand-in for the sublayer


def input_chain(x, fn, base, scale, g):
    """A V4 site's chain before its sublayer: the coefficients, then collapse + RMSNorm with their pre."""
    pre = mhc_coefficients_triton_adaptive(x, fn, base, scale, *EPS)[0]
    return mhc_collapse_rms_norm_triton(x, pre, g, 1e-6)


def pre_input(x, fn, base, scale, g):
    """The same input from the site's pre rows alone (the model's path up to 64 tokens)."""
    return mhc_pre_collapse_rms_norm_triton_adaptive(x, fn[:N], base[:N], scale[:1], g, *EPS[:2], 1e-6)


def boundary(x, y, post, comb, pre, g):
    """A V4.1 site's expand, then the next site's input from the new streams (collapse + RMSNorm)."""
    out = mhc_expand_triton(x, y, post, comb)
    return out, mhc_collapse_rms_norm_triton(out, pre, g, 1e-6)


def boundary_fused(x, y, post, comb, pre, g):
    """The same with the collapse made by the expand (``deepseek_v41.EXPAND_COLLAPSE``)."""
    out, u = mhc_expand_collapse_triton(x, y, post, comb, pre)
    return out, rms_norm_triton(u, g, 1e-6)


def graph_ms(fn, *args) -> float:
    """Median ms of one CUDA-graph replay of ``fn(*args)`` (captured after a warm-up call)."""
    fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    return float(triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    rec = Recorder("bench_mhc")
    ceiling = copy_ceiling_gbs()
    rec.add(case="copy_ceiling", gbs=ceiling)
    triton_ops = (mhc_coefficients_triton, mhc_collapse_triton, mhc_expand_triton)
    ref_ops = (mhc_coefficients_ref, mhc_collapse_ref, mhc_expand_ref)
    for d in (4096, 5120):
        k, rows = N * d, (2 + N) * N
        fn = torch.randn(rows, k, device="cuda") * 2 / k**0.5
        base = torch.randn(rows, device="cuda") * 0.5
        scale = 0.5 + torch.rand(3, device="cuda")
        for t in (1, 8, 64, 256, 4096, 8192):
            x = torch.randn(t, N, d, device="cuda", dtype=torch.bfloat16)
            sx, sd, sc = t * N * d * 2, t * d * 2, t * rows * 4  # streams, one stream, coefficient bytes
            nbytes = (sx + rows * k * 4 + sc) + (sx + t * N * 4 + sd) + (sx + sd + sc + sx)
            ms = bench_ms(sublayer, *triton_ops, x, fn, base, scale)
            ref_ms = bench_ms(sublayer, *ref_ops, x, fn, base, scale)
            pre, post, comb = mhc_coefficients_triton(x, fn, base, scale, *EPS)
            u = mhc_collapse_triton(x, pre)
            parts = {
                "coef_us": 1e3 * bench_ms(mhc_coefficients_triton, x, fn, base, scale, *EPS),
                "collapse_us": 1e3 * bench_ms(mhc_collapse_triton, x, pre),
                "expand_us": 1e3 * bench_ms(mhc_expand_triton, x, u, post, comb),
            }
            g = 0.5 + torch.rand(d, device="cuda")
            for name, fn_ in (("boundary", boundary), ("boundary_fused", boundary_fused)):
                parts[f"{name}_us"] = 1e3 * bench_ms(fn_, x, u, post, comb, pre, g)
                if t <= GRAPH_MAX_T:
                    parts[f"{name}_graph_us"] = 1e3 * graph_ms(fn_, x, u, post, comb, pre, g)
            if t <= GRAPH_MAX_T:
                parts["graph_us"] = 1e3 * graph_ms(sublayer, *triton_ops, x, fn, base, scale)
                parts["ref_graph_us"] = 1e3 * graph_ms(sublayer, *ref_ops, x, fn, base, scale)
                adaptive = (mhc_coefficients_triton_adaptive, *triton_ops[1:])
                parts["adaptive_graph_us"] = 1e3 * graph_ms(sublayer, *adaptive, x, fn, base, scale)
                parts["input_chain_graph_us"] = 1e3 * graph_ms(input_chain, x, fn, base, scale, g)
                parts["pre_input_graph_us"] = 1e3 * graph_ms(pre_input, x, fn, base, scale, g)
            gbs = nbytes / ms / 1e6
            rec.add(case="mhc_same_site", d=d, tokens=t, mbytes=nbytes / 1e6, us=ms * 1e3, gbs=gbs,
                    pct_ceiling=100 * gbs / ceiling, floor_us=nbytes / ceiling / 1e3, ref_us=ref_ms * 1e3,
                    speedup_vs_ref=ref_ms / ms, **parts)  # fmt: skip


if __name__ == "__main__":
    main()

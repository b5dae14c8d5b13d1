"""The sorted-layout MoE's data movement around its expert GEMMs (CUDA), at the decode batches that take the sorted
layout (V4.1-Flash: 384 experts, V4-Flash: 256; top 6; 8 / 64 / 256 tokens, and 256 routed over 90 experts as the
model slice's random routers do), warm (``graph_us``) and cold (``cold_us``):

* ``chain``: what the MXFP4 MoE ran before session 35: ``moe_permute``'s reference (argsort, searchsorted, the
  sorted copy of x), ``weights.flatten()[order]`` and the unpermute's inverse (arange + scatter);
* ``sort_rows``: ``moe_sort_rows`` (the Triton counting sort: order, offsets, inverse, row tokens and weights in one
  launch) and the sorted copy ``x.index_select(0, row_token)``.

Both give the same integers and rows (checked, bitwise, before timing). Run from the repository root:
``python packages/deepinfer-kernels/benchmarks/bench_moe_sort.py``; writes
``benchmarks/results/bench_moe_sort.jsonl`` and prints a table last.
"""

import torch
from _bench_util import Recorder, cold_us, graph_us
from deepinfer_kernels.ops.moe_permute.reference import inverse_order, moe_permute_ref
from deepinfer_kernels.ops.moe_permute.triton import moe_sort_rows_triton

MODELS = {"v4.1": (384, 5120), "v4": (256, 4096)}  # experts, hidden
TOP_K = 6
CASES = ("8", "64", "256", "256/90")  # tokens, or tokens / experts hit


def _chain(x, experts, weights, e):
    xs, order, offsets = moe_permute_ref(x, experts, e)
    return xs, order, offsets, inverse_order(order), weights.flatten()[order]


def _sort_rows(x, experts, weights, e):
    order, offsets, inverse, row_token, row_weight = moe_sort_rows_triton(experts, weights, e)
    return x.index_select(0, row_token), order, offsets, inverse, row_weight


def main() -> None:
    rec = Recorder("bench_moe_sort")
    table = []
    for model, (e, d) in MODELS.items():
        for spec in CASES:
            t, _, hot = spec.partition("/")
            t, hot = int(t), int(hot) if hot else e
            x = torch.randn(t, d, device="cuda").to(torch.bfloat16)
            experts = torch.rand(t, e, device="cuda").argsort(1)[:, :TOP_K] % hot
            weights = torch.rand(t, TOP_K, device="cuda")
            want, got = _chain(x, experts, weights, e), _sort_rows(x, experts, weights, e)
            for name, a, b in zip(("rows", "order", "offsets", "inverse", "weights"), want, got, strict=True):
                if not torch.equal(a, b):
                    raise SystemExit(f"{model} T={spec}: {name} differ between the chain and moe_sort_rows")
            row = {"model": model, "T": spec}
            for impl, fn in (("chain", _chain), ("sort_rows", _sort_rows)):

                def call(fn=fn, x=x, experts=experts, weights=weights, e=e):
                    return fn(x, experts, weights, e)

                row[f"{impl}_warm_us"], row[f"{impl}_cold_us"] = graph_us(call), cold_us(call)
            rec.add(case="moe_sort", experts=e, top_k=TOP_K, **row)
            table.append(row)
    print(f"\n{'model':6} {'T':>7} {'chain warm/cold us':>22} {'sort_rows warm/cold us':>24}")
    for r in table:
        print(f"{r['model']:6} {r['T']:>7} {r['chain_warm_us']:10.1f} /{r['chain_cold_us']:9.1f}"
              f" {r['sort_rows_warm_us']:12.1f} /{r['sort_rows_cold_us']:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

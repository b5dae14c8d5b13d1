"""moe_route_topk microbenchmark (CUDA): the Triton router (one launch) at the models' shapes (V4-Flash: 256
experts, V4.1-Flash: 384; top 6, sqrtsoftplus with a bias, scale 1.5) and rows 1 / 8 / 64 / 256, warm
(``graph_us``) and cold (``cold_us``: after a 256 MB copy, as between a decode step's weight streams), for each
warp count against the reference's chain of torch kernels in the same graphs. Each warp count's picks are checked
equal to the reference's and its weights within 1e-5 relative before it is timed. Alone it does not show what a
decode step pays: one warp reads about the same here (H200, session 23: ``benchmarks/baselines/ab_session23.log``)
and costs 4-10 us a MoE layer in a step, beside weight-stream programs on the same SMs.

Run from the repository root: ``python packages/deepinfer-kernels/benchmarks/bench_moe_route.py``.
Writes ``benchmarks/results/bench_moe_route.jsonl``.
"""

import torch
from _bench_util import Recorder, cold_us, graph_us
from deepinfer_kernels.ops.moe import route_triton
from deepinfer_kernels.ops.moe.reference import moe_route_topk_ref

MODELS = {"v4": 256, "v4.1": 384}
TOP_K, SCALE = 6, 1.5
WARPS = (1, 2, 4, 8)


def main() -> None:
    rec = Recorder("bench_moe_route")
    table = []
    saved = route_triton.ROUTE_WARPS
    try:
        for model, experts in MODELS.items():
            bias = torch.randn(experts, device="cuda") * 0.1
            for rows in (1, 8, 64, 256):
                logits = torch.randn(rows, experts, device="cuda")

                def ref(logits=logits, bias=bias):
                    return moe_route_topk_ref(logits, bias, TOP_K, route_scale=SCALE)

                ref_w, ref_e = ref()
                row = {"model": model, "rows": rows, "ref_warm_us": graph_us(ref), "ref_cold_us": cold_us(ref)}
                for warps in WARPS:
                    route_triton.ROUTE_WARPS = warps

                    def ours(logits=logits, bias=bias):
                        return route_triton.moe_route_topk_triton(logits, bias, TOP_K, route_scale=SCALE)

                    w, e = ours()
                    if not torch.equal(e, ref_e) or not torch.allclose(w, ref_w, rtol=1e-5, atol=0):
                        raise SystemExit(f"{model} rows={rows} warps={warps}: routes differ from the reference")
                    row[f"w{warps}_warm_us"] = graph_us(ours)
                    row[f"w{warps}_cold_us"] = cold_us(ours)
                rec.add(case="route", top_k=TOP_K, experts=experts, **row)
                table.append(row)
    finally:
        route_triton.ROUTE_WARPS = saved
    cols = ["ref"] + [f"w{w}" for w in WARPS]
    print(f"\n{'model':6} {'rows':>5} " + " ".join(f"{c + ' warm/cold us':>20}" for c in cols))
    for row in table:
        cells = " ".join(f"{row[c + '_warm_us']:9.1f} /{row[c + '_cold_us']:9.1f}" for c in cols)
        print(f"{row['model']:6} {row['rows']:5d} {cells}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# GPU check of the Triton GEMM family (issue 5): fp8_gemm_nt (+ act_quant_fp8), the MXFP4 expert GEMMs and
# moe_permute/unpermute. Their CUDA tests, then their microbenchmarks, then a short table. On a CUDA machine:
#   bash benchmarks/gpu_kernels_gemm.sh [--quick]
# Results: benchmarks/results/{fp8_gemm,mxfp4_grouped_gemm}.jsonl (appended).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/packages/deepinfer-kernels/src${PYTHONPATH:+:$PYTHONPATH}"
KB=packages/deepinfer-kernels/benchmarks
T=packages/deepinfer-kernels/tests/ops
status=0
echo "== GPU tests"
python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
  "$T/test_fp8_gemm.py" "$T/test_mxfp4_grouped_gemm.py" "$T/test_moe_permute.py" || status=1
mkdir -p benchmarks/results && touch benchmarks/results/.gpu_kernels_gemm.since && sleep 1
for b in bench_fp8_gemm bench_mxfp4_grouped_gemm; do
  echo "== $b"
  python "$KB/$b.py" "$@" || status=1
done
echo "== summary (this run; best Triton variant, % of the ceilings measured in the same run)"
python - <<'PY'
import json, pathlib
res = pathlib.Path("benchmarks/results")
since = (res / ".gpu_kernels_gemm.since").stat().st_mtime
def rows(name):
    p = res / f"{name}.jsonl"
    if not p.exists() or p.stat().st_mtime < since:
        return []
    out = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    t0 = max(r["time"] for r in out)
    return [r for r in out if r["time"] == t0 and r.get("kind") == "op"]
fmt = "{:<34} {:>8} {:>10} {:>9} {:>9} {:>11}"
print(fmt.format("case", "M/T", "best us", "TFLOP/s", "GB/s", "x vs torch"))
fp8 = rows("fp8_gemm")
for key in sorted({(r["shape"], r["M"]) for r in fp8}, key=lambda k: (k[0], k[1])):
    rs = {r["impl"]: r for r in fp8 if (r["shape"], r["M"]) == key}
    best = min((rs[i] for i in ("triton", "triton_fixed") if i in rs), key=lambda r: r["us"])
    peer = min(rs[i]["us"] for i in ("torch_dequant_mm", "torch_bf16_mm") if i in rs)
    print(fmt.format(f"fp8 {key[0]} [{best['impl']}]", key[1], f"{best['us']:.1f}", f"{best['TFLOPs']:.0f}",
                     f"{best['GBps']:.0f}", f"{peer / best['us']:.2f}"))
mx = rows("mxfp4_grouped_gemm")
for key in sorted({(r["proj"], r["T"]) for r in mx if r["proj"] != "moe_permute"}):
    rs = {r["impl"]: r for r in mx if (r["proj"], r["T"]) == key}
    best = min((rs[i] for i in ("contiguous", "gather") if i in rs), key=lambda r: r["us"])
    peer = rs["torch_bf16_weights"]["us"]
    print(fmt.format(f"mxfp4 {key[0]} [{best['impl']}]", key[1], f"{best['us']:.1f}", f"{best['TFLOPs']:.0f}",
                     f"{best['GBps']:.0f}", f"{peer / best['us']:.2f}"))
PY
exit $status

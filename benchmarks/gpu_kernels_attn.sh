#!/usr/bin/env bash
# GPU check of the Triton attention / selection / norm kernels (issue 5): their CUDA tests, then their
# microbenchmarks, then a short table of the headline numbers. Run from anywhere on a CUDA machine:
#   bash benchmarks/gpu_kernels_attn.sh
# Results: benchmarks/results/bench_{rms_norm,sparse_mqa_attention,topk_select}.jsonl (appended).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/packages/deepinfer-kernels/src${PYTHONPATH:+:$PYTHONPATH}"
KB=packages/deepinfer-kernels/benchmarks
TESTS=(
  packages/deepinfer-kernels/tests/ops/test_rms_norm_triton.py
  packages/deepinfer-kernels/tests/ops/test_sparse_mqa_attention_triton.py
  packages/deepinfer-kernels/tests/ops/test_topk_select_triton.py
)
[ -f packages/deepinfer-kernels/tests/ops/test_indexer_triton.py ] && TESTS+=(packages/deepinfer-kernels/tests/ops/test_indexer_triton.py)
BENCHES=(bench_rms_norm bench_topk_select bench_sparse_mqa_attention)
[ -f "$KB/bench_indexer_scores.py" ] && BENCHES+=(bench_indexer_scores)

status=0
echo "== GPU tests"
python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu "${TESTS[@]}" || status=1
rm -f benchmarks/results/.gpu_kernels_attn.since && mkdir -p benchmarks/results && touch benchmarks/results/.gpu_kernels_attn.since
sleep 1
for b in "${BENCHES[@]}"; do
  echo "== $b"
  python "$KB/$b.py" || status=1
done
echo "== summary (this run)"
python - <<'PY'
import json, pathlib
res = pathlib.Path("benchmarks/results")
since = (res / ".gpu_kernels_attn.since").stat().st_mtime
def rows(name):
    p = res / f"{name}.jsonl"
    if not p.exists() or p.stat().st_mtime < since:
        return []
    out = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    t0 = max(r["time"] for r in out)  # the last run's rows share its start stamp
    return [r for r in out if r["time"] == t0]
fmt = "{:<40} {:>10} {:>10} {:>14}"
print(fmt.format("case", "us", "% ceiling", "x vs torch"))
for r in rows("bench_rms_norm"):
    if r["case"] == "rms_norm" and r["rows"] in (1, 64, 65536):
        print(fmt.format(f"rms_norm d={r['d']} rows={r['rows']}", f"{r['us']:.1f}", f"{r['pct_ceiling']:.0f}% copy", f"{r['speedup_vs_torch']:.2f}"))
for r in rows("bench_topk_select"):
    if r["case"] == "topk":
        print(fmt.format(f"topk k=512 n={r['n']} rows={r['rows']}", f"{r['us']:.1f}", f"{r['pct_ceiling']:.0f}% copy", f"{r['speedup_vs_torch']:.2f}"))
for r in rows("bench_sparse_mqa_attention"):
    if r["case"] == "decode":
        print(fmt.format(f"attn decode {r['backend']} b={r['batch']} ctx={r['context']}", f"{r['us']:.1f}", f"{r['pct_copy']:.0f}% copy", f"{r['speedup_vs_torch']:.2f}"))
    elif r["case"] == "prefill":
        print(fmt.format(f"attn prefill {r['backend']} T={r['tokens']}", f"{r['us']:.1f}", f"{r['pct_matmul']:.0f}% mm", f"{r['speedup_vs_torch']:.2f}"))
sweep = [r for r in rows("bench_sparse_mqa_attention") if r["case"] == "sweep" and "us" in r]
for label in sorted({r["label"] for r in sweep}):
    best = min((r for r in sweep if r["label"] == label), key=lambda r: r["us"])
    print(f"best tile {label}: split={best['split']} block_h={best['block_h']} block_n={best['block_n']} "
          f"warps={best['warps']} stages={best['stages']} -> {best['us']:.1f} us")
for r in rows("bench_indexer_scores"):
    if r.get("case") == "indexer_scores":
        pct = f"{r['pct_matmul']:.0f}% mm" if r["s"] >= 1024 else f"{r['pct_copy']:.0f}% copy"
        print(fmt.format(f"indexer_scores S={r['s']} N={r['n']}", f"{r['us']:.1f}", pct, f"{r['speedup_vs_torch']:.2f}"))
PY
exit $status

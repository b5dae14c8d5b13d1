#!/usr/bin/env bash
# Model-level GPU benchmark (issue 5): V4.1-Flash and V4-Flash slices, ours vs transformers 5.23.0, floors,
# batch-invariance check (issue 7). On a CUDA machine, from the repository root:
#   bash benchmarks/gpu_model_slice.sh [extra args of benchmarks/gpu_model_slice.py]
# transformers 5.23.0 must be importable (carry its wheel: pip install --no-deps --target /tmp/site ...).
# Results: $OUT/gpu_model_slice.json (or benchmarks/results/), the log on stdout, a table last.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT/packages/deepinfer-kernels/src:$ROOT/packages/deepinfer-runtime/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import transformers; print('transformers', transformers.__version__)" || true
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>/dev/null || true
python3 benchmarks/gpu_model_slice.py "$@"

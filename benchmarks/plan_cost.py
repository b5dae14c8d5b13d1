"""Host cost of planning a decode step (``plan_decode``, ``decode_batch``) at full depth, on the CPU.

A planned decode step is built on the host before the device runs it: for every request, every ring of the slot
pool (one window per layer, the compressors' projection rings) and every paged store is read and advanced in
Python. The model slices of ``gpu_model_slice.py`` have 4 and 8 layers; this measures the released depths (V4-Flash
43 layers of alternating CSA / HCA, V4.1-Flash 40 layers) with tiny widths (the plan does not depend on them), at
batch 8 / 64 / 256: one request is prefilled to ``--context`` tokens and copied to every request of the batch in the
engine's layout (``replicate_cache``), then ``plan_decode`` is timed alone (median of ``--steps``). With async
scheduling the engine hides this behind the device's previous step only while it is the shorter of the two.

    python benchmarks/plan_cost.py [--models v4,v4.1] [--batches 8,64,256] [--context 512] [--out plan_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_model_slice import PAGE_TOKENS, prefill, rand_ids, tiny_dims  # noqa: E402

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def build(arch: str):
    """The full-depth model with tiny widths (window 128 as released), on the CPU in fp32."""
    from deepinfer_runtime.testing import model_slice as ms

    dims = {**tiny_dims(arch), "sliding_window": 128}
    if arch == "v4":
        cfg = ms.v4_slice_config(tuple([CSA, HCA] * 21 + [CSA]), hash_layers=3, **dims)
        return ms.build_random_model(cfg, "cpu", torch.float32, experts="distinct")
    layers = tuple(range(ms.RELEASED_V41_TEXT["num_hidden_layers"]))
    cfg = ms.v41_slice_config(layers, engram_vocab_size=100, **dims)
    return ms.build_random_model(cfg, "cpu", torch.float32, experts="shared", yoco_mode="compact")


def plan_ms(model, arch: str, batch: int, context: int, steps: int) -> float:
    from deepinfer_runtime.kv_pool import KVPools
    from deepinfer_runtime.testing.model_slice import replicate_cache

    blocks = -(-context // PAGE_TOKENS) + 1
    pools = KVPools(blocks + 2 * batch + 2, PAGE_TOKENS, "cpu")
    table = list(range(blocks))
    base = model.new_cache(new_rows=pools.factory(table))
    prefill(model, arch, [base], [rand_ids(context, "cpu", torch.Generator().manual_seed(0))], 4096, "cpu")
    caches = replicate_cache(base, batch, pools, table, iter(range(blocks, pools.num_blocks)))
    chunks = [torch.tensor([5]) for _ in range(batch)]
    times = []
    for _ in range(steps):  # each plan advances the caches as its step would (no device work runs)
        t = time.perf_counter()
        plan = model.plan_decode(chunks, caches) if arch == "v4" else model.plan_decode(chunks, caches, None)
        times.append(time.perf_counter() - t)
        if plan is None:
            raise RuntimeError(f"{arch}: the step was not planned (general path)")
        for c in caches:
            c.seq_len += 1
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="v4,v4.1")
    ap.add_argument("--batches", default="8,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / "plan_cost.json")
    args = ap.parse_args()
    rows = []
    for arch in args.models.split(","):
        model = build(arch)
        for b in (int(x) for x in args.batches.split(",")):
            ms = plan_ms(model, arch, b, args.context, args.steps)
            rows.append({"model": arch, "layers": len(model.layers), "batch": b, "plan_ms": ms})
            print(f"{arch} ({len(model.layers)} layers) batch {b}: plan_decode {ms:.1f} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": os.cpu_count(), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\n{'model':<6} {'layers':>6} {'batch':>6} {'plan ms':>8}")
    for r in rows:
        print(f"{r['model']:<6} {r['layers']:>6} {r['batch']:>6} {r['plan_ms']:>8.1f}")


if __name__ == "__main__":
    main()

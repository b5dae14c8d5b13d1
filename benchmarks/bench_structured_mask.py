"""Per-step cost of structured outputs' token mask on the CPU (and CUDA when available).

    python benchmarks/bench_structured_mask.py [--steps 30] [--output-json benchmarks/results/structured_mask.json]

For B = 1, 8, 64 requests under a JSON schema (the real DeepSeek tokenizer, vocabulary 129,280), each request
walks a random valid document (a random allowed token is consumed after each step), and per step we time:
  (a) fill: the [B, ceil(V/32)] int32 bitmask, filled by llguidance for all B rows in one call
      (``structured.mask.fill_bitmask``);
  (b) apply: ``deepinfer_kernels.apply_token_bitmask`` on [B, 129280] fp32 logits (all rows constrained),
      on the CPU, and on CUDA when a GPU is present (bitmask copied to the device, included in the time).
Prints a table of median microseconds per step and writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from deepinfer_kernels import apply_token_bitmask
from deepinfer_runtime import SamplingParams
from deepinfer_runtime.llm import default_model_dir
from deepinfer_runtime.structured import start_grammar
from deepinfer_runtime.structured.mask import fill_bitmask
from deepinfer_runtime.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "tags", "color"],
    "additionalProperties": False,
}


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


def bench_fill(tokenizer: Tokenizer, batch: int, steps: int, vocab: int, seed: int = 0) -> float:
    spec = SamplingParams(structured_outputs={"json": SCHEMA}).grammar_spec
    grammars = [start_grammar(spec, tokenizer, vocab, {1}) for _ in range(batch)]
    assert all(g.wait() for g in grammars)
    gen = torch.Generator().manual_seed(seed)
    shifts = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        bitmask, _ = fill_bitmask(grammars, vocab)
        times.append(time.perf_counter() - t0)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
        for b, g in enumerate(grammars):  # walk on: one random allowed token per request (not timed)
            ids = allowed[b].nonzero().flatten()
            ids = ids[ids != 1] if len(ids) > 1 else ids  # prefer continuing over EOS
            g.accept(int(ids[torch.randint(len(ids), (1,), generator=gen)]))
            if g.is_finished or g.error:
                grammars[b] = start_grammar(spec, tokenizer, vocab, {1})
                grammars[b].wait()
    return _median_us(times)


def bench_apply(batch: int, vocab: int, device: str, steps: int) -> float:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=gen).to(device)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    rows = torch.arange(batch, device=device)
    times = []
    for _ in range(steps + 3):
        work = logits.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        apply_token_bitmask(work, bitmask.to(device, non_blocking=True), rows)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return _median_us(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--output-json", default="benchmarks/results/structured_mask.json")
    args = ap.parse_args()
    tokenizer = Tokenizer(default_model_dir())
    vocab = tokenizer.vocab_size
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    start_grammar(SamplingParams(structured_outputs={"json": SCHEMA}).grammar_spec, tokenizer, vocab, {1}).wait()
    first_compile_s = time.perf_counter() - t0  # includes building the llguidance tokenizer once
    rows = []
    for b in args.batches:
        row = {"batch": b, "vocab": vocab, "fill_us": bench_fill(tokenizer, b, args.steps, vocab)}
        for d in devices:
            row[f"apply_{d}_us"] = bench_apply(b, vocab, d, args.steps)
        rows.append(row)
    cols = ["batch", "fill_us"] + [f"apply_{d}_us" for d in devices]
    print(f"first compile (tokenizer + schema): {first_compile_s:.2f} s; torch threads {torch.get_num_threads()}")
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.0f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"first_compile_s": first_compile_s, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

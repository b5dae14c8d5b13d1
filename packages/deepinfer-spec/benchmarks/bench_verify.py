"""CPU time of speculative verification at V4.1-Flash's vocabulary.

    python packages/deepinfer-spec/benchmarks/bench_verify.py [--batch 1 8 64] [--drafts 5] [--repeats 5] [--threads 0]
        [--device cpu]
        [--output-json benchmarks/results/bench_verify.json]

For each batch size B: random processed target log-distributions [B, N+1, V] (V = 129280), a draft
distribution near them, drafts sampled from it; times ``rejection_verify`` (procedure V) and
``block_verify`` (median of the repeats, after one warm-up call). Prints a table and writes JSON
(path relative to the repository root unless absolute).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from deepinfer_kernels.ops.sampling import DRAFT_SEED_OFFSET, draw_tokens
from deepinfer_spec import Drafts, block_verify, rejection_verify

REPO_ROOT = Path(__file__).resolve().parents[3]
VOCAB = 129280


def make_inputs(b: int, n: int, v: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    target_logits = (torch.randn(b, n + 1, v, generator=gen) * 2.0).to(device)
    draft_logits = target_logits[:, :n] + torch.randn(b, n, v, generator=gen).to(device)
    target = torch.log_softmax(target_logits, -1)
    draft_lp = torch.log_softmax(draft_logits, -1)
    seeds = torch.arange(b, dtype=torch.int64, device=device) * 7919 + 1
    positions = torch.full((b,), 1000, dtype=torch.int64, device=device)
    tokens = torch.stack(
        [draw_tokens(draft_lp[:, k], seeds + DRAFT_SEED_OFFSET, positions + k + 1) for k in range(n)], 1
    )
    num_verified = torch.full((b,), n, dtype=torch.int64, device=device)
    return target, Drafts(tokens, draft_lp), num_verified, seeds, positions


def time_call(fn, args, repeats: int) -> float:
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    fn(*args)  # warm-up
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn(*args)
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--drafts", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the reference ops on the GPU)")
    ap.add_argument("--output-json", default="benchmarks/results/bench_verify.json")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    rows = []
    for b in args.batch:
        inputs = make_inputs(b, args.drafts, args.vocab, seed=b, device=args.device)
        res = rejection_verify(*inputs)
        row = {
            "batch": b,
            "drafts": args.drafts,
            "vocab": args.vocab,
            "rejection_ms": time_call(rejection_verify, inputs, args.repeats),
            "block_ms": time_call(block_verify, inputs, args.repeats),
            "mean_accepted_rejection": float(res.num_accepted.double().mean()),
            "mean_accepted_block": float(block_verify(*inputs).num_accepted.double().mean()),
        }
        rows.append(row)
        del inputs

    print(f"{'B':>4} {'N':>3} {'V':>7} {'rejection ms':>13} {'block ms':>10} {'acc (V)':>8} {'acc (blk)':>9}")
    for r in rows:
        print(
            f"{r['batch']:>4} {r['drafts']:>3} {r['vocab']:>7} {r['rejection_ms']:>13.2f} {r['block_ms']:>10.2f} "
            f"{r['mean_accepted_rejection']:>8.2f} {r['mean_accepted_block']:>9.2f}"
        )
    out = Path(args.output_json)
    out = out if out.is_absolute() else REPO_ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    out.write_text(json.dumps({"bench": "bench_verify", "meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

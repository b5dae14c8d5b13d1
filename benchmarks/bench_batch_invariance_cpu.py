"""What batch invariance costs on the CPU.

    python benchmarks/bench_batch_invariance_cpu.py [--requests 16] [--max-tokens 16] [--output-json PATH]

Runs the engine on a tiny random DeepSeek-V4.1 checkpoint (same prompts, greedy) three ways:
  1. batch-invariant mode on (``LLM(batch_invariant=True)``);
  2. mode off with only the references registered (they are row-invariant by construction, so this is
     the same computation: the mode itself costs nothing on the CPU);
  3. mode off with a plain ``F.linear`` backend registered for ``linear`` (not row-invariant): the speed
     a non-invariant dense matmul would buy, i.e. the price of the fixed 16-row tiles.
Prints a table (wall time, output tokens/s, ratio to run 1) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from deepinfer_kernels import registry
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint


def _run(path: Path, prompts, max_tokens: int, invariant: bool) -> tuple[float, int]:
    llm = LLM(
        model=path,
        dtype="float32",
        device="cpu",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=512,
        batch_invariant=invariant,
        yoco_mode="off",
        log_stats=False,
    )
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--output-json", default="benchmarks/results/batch_invariance_cpu.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 129000, (int(n),), generator=g).tolist()
        for n in torch.randint(16, 200, (args.requests,), generator=g)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(Path(tmp) / "v41", "v4.1", "fp8+fp4", seed=0)
        results = {
            "invariant mode on": _run(path, prompts, args.max_tokens, True),
            "mode off, references": _run(path, prompts, args.max_tokens, False),
        }
        registry.register_backend(
            "linear",
            "torch_f_linear",
            lambda x, w: F.linear(x, w.to(x.dtype)),
            devices=("cpu", "cuda"),
            priority=1,
            batch_invariant=False,
        )
        results["mode off, plain F.linear"] = _run(path, prompts, args.max_tokens, False)
    base = results["invariant mode on"][0]
    rows = [
        {"run": k, "wall_s": t, "output_tokens": n, "output_tokens_per_s": n / t, "time_vs_invariant": t / base}
        for k, (t, n) in results.items()
    ]
    print(f"{'run':<28}{'wall s':>8}{'out tok/s':>11}{'time / invariant':>18}")
    for r in rows:
        print(f"{r['run']:<28}{r['wall_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}{r['time_vs_invariant']:>18.2f}")
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "threads": torch.get_num_threads(),
                "runs": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

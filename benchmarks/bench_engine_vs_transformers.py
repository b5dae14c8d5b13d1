"""CPU benchmark: the DeepInfer engine vs transformers ``generate`` on the same tiny DeepSeek-V4 checkpoint.

Run from the repository root (defaults: 16 prompts of 32..256 random token ids, greedy, 32 new tokens, EOS
ignored; a tiny random V4 checkpoint is written to a temporary directory unless ``--model DIR`` is given)::

    python benchmarks/bench_engine_vs_transformers.py
    python benchmarks/bench_engine_vs_transformers.py --max-tokens 64 --output-json /tmp/bench.json
    python benchmarks/bench_engine_vs_transformers.py --profile 10   # + cProfile of one more engine run

Systems (each warmed up once on a short prompt; load time excluded):

- ``deepinfer``: one ``LLM(...).generate(all prompts)`` (continuous batching, chunked prefill);
- ``transformers``: ``model.generate`` on each prompt alone (batch 1, no padding);
- ``transformers-batched``: one left-padded ``model.generate`` with ``attention_mask`` over all prompts. It is
  reported only when its tokens equal the per-prompt run exactly; otherwise the reason is printed and stored.

Correctness is checked in the same run: DeepInfer's greedy tokens must equal transformers' per-prompt tokens
(the match count is printed and stored). The table printed last and the JSON (``--output-json``) carry, per
system: requests, input_tokens, output_tokens, elapsed_s, requests_per_s, output_tokens_per_s,
total_tokens_per_s; plus ``ratio`` = DeepInfer throughput / transformers throughput (= transformers wall time /
DeepInfer wall time; > 1 means DeepInfer is faster) and the torch thread count.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO_ROOT / "benchmarks" / "results" / "engine_vs_transformers_cpu.json"
TOKEN_LOW, TOKEN_HIGH = 3, 129000  # random prompt ids avoid BOS (0), EOS (1) and the special tokens at the top


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: tiny V4 in a temp dir)")
    p.add_argument("--checkpoint-seed", type=int, default=0, help="seed of the tiny checkpoint (default 0)")
    p.add_argument("--num-prompts", type=int, default=16, help="number of prompts N (default 16)")
    p.add_argument("--min-len", type=int, default=32, help="shortest prompt, tokens (default 32)")
    p.add_argument("--max-len", type=int, default=256, help="longest prompt, tokens (default 256)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per prompt M (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and ids (default 0)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine max_num_seqs (default: N)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="engine token budget/step (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="engine KV block size (default 16)")
    p.add_argument("--warmup-len", type=int, default=8, help="length of the warm-up prompt (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    p.add_argument("--skip-batched", action="store_true", help="do not try the left-padded batched HF generate")
    p.add_argument("--profile", type=int, default=0, help="cProfile one more engine run; print top K (default 0)")
    p.add_argument("--output-json", type=Path, default=DEFAULT_JSON, help=f"results JSON (default {DEFAULT_JSON})")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.num_prompts < 1 or args.max_tokens < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    return args


def make_prompts(n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(TOKEN_LOW, TOKEN_HIGH, (n_tok,), generator=g).tolist() for n_tok in lengths]


def stats(requests: int, input_tokens: int, output_tokens: int, elapsed: float) -> dict[str, Any]:
    return {
        "requests": requests,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 4),
        "requests_per_s": round(requests / elapsed, 3),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 2),
    }


# --- DeepInfer ---------------------------------------------------------------------------------------------
def build_engine(path: Path, args: argparse.Namespace):
    from deepinfer_runtime import LLM

    return LLM(
        model=path,
        dtype="float32",
        device="cpu",
        max_num_seqs=args.max_num_seqs or args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        log_stats=False,
    )


def run_engine(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from deepinfer_runtime import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for o in outs:
        if o.error:
            raise RuntimeError(f"engine rejected a request: {o.error}")
    return [list(o.outputs[0].token_ids) for o in outs], elapsed


# --- transformers ------------------------------------------------------------------------------------------
def hf_generate_alone(model, prompts: list[list[int]], max_tokens: int, desc: str) -> tuple[list[list[int]], float]:
    out: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt in tqdm(prompts, desc=desc, unit="req", leave=False, file=sys.stderr):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out, time.perf_counter() - start


def hf_generate_batched(model, prompts: list[list[int]], max_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        gen = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    return [row[longest:].tolist() for row in gen], elapsed


# --- report ------------------------------------------------------------------------------------------------
def format_table(rows: list[tuple[str, dict[str, Any], float | None]]) -> str:
    head = f"{'system':<22} {'wall s':>9} {'out tok/s':>10} {'total tok/s':>12} {'ours/this':>10}"
    lines = [head, "-" * len(head)]
    for name, s, ratio in rows:
        r = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"{name:<22} {s['elapsed_s']:>9.2f} {s['output_tokens_per_s']:>10.1f} {s['total_tokens_per_s']:>12.1f} "
            f"{r:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed)
    n, m = len(prompts), args.max_tokens
    n_in = sum(len(p) for p in prompts)
    warm = make_prompts(1, args.warmup_len, args.warmup_len, args.seed + 1)
    print(
        f"[bench] {n} prompts, lengths {min(map(len, prompts))}..{max(map(len, prompts))} ({n_in} input tokens), "
        f"{m} new tokens each, greedy, EOS ignored; torch {torch.__version__}, {threads} threads",
        file=sys.stderr,
    )

    tmp = None
    if args.model is None:
        from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="bench-tiny-v4-")
        path = write_tiny_checkpoint(Path(tmp.name) / "v4", "v4", "none", seed=args.checkpoint_seed)
        print(f"[bench] wrote tiny V4 checkpoint (seed {args.checkpoint_seed}) to {path}", file=sys.stderr)
    else:
        path = args.model
    results: dict[str, Any] = {
        "model": str(args.model) if args.model else f"tiny v4 none seed {args.checkpoint_seed} (temp dir)",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch_version": torch.__version__,
        "torch_num_threads": threads,
        "prompt_lengths": [len(p) for p in prompts],
    }
    try:
        # DeepInfer
        llm = build_engine(path, args)
        run_engine(llm, warm, m)
        ours, t_ours = run_engine(llm, prompts, m)
        results["deepinfer"] = s_ours = stats(n, n_in, sum(map(len, ours)), t_ours)
        print(f"[bench] deepinfer: {t_ours:.2f} s, {llm.engine.num_steps} engine steps in total", file=sys.stderr)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            run_engine(llm, prompts, m)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile)
            print(f"[bench] cProfile of one more engine run (top {args.profile} by cumulative time):", file=sys.stderr)
            print(buf.getvalue(), file=sys.stderr)

        # transformers
        from transformers import DeepseekV4ForCausalLM

        model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_generate_alone(model, warm, m, "hf warm-up")
        theirs, t_hf = hf_generate_alone(model, prompts, m, "transformers (alone)")
        results["transformers"] = s_hf = stats(n, n_in, sum(map(len, theirs)), t_hf)
        match = sum(a == b for a, b in zip(ours, theirs))
        results["matching_prompts"] = match
        results["ratio"] = round(t_hf / t_ours, 3)
        rows: list[tuple[str, dict[str, Any], float | None]] = [
            ("deepinfer", s_ours, None),
            ("transformers", s_hf, t_hf / t_ours),
        ]

        # transformers, batched with left padding: reported only when exact
        batched: dict[str, Any] = {"attempted": not args.skip_batched, "reported": False}
        if not args.skip_batched:
            pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
            try:
                hf_generate_batched(model, warm + warm, m, pad_id)
                tb, t_b = hf_generate_batched(model, prompts, m, pad_id)
                exact = sum(a == b for a, b in zip(tb, theirs))
                batched.update(stats(n, n_in, sum(map(len, tb)), t_b), matching_per_prompt_hf=exact)
                if exact == n:
                    batched["reported"] = True
                    results["ratio_vs_batched"] = round(t_b / t_ours, 3)
                    rows.append(("transformers-batched", batched, t_b / t_ours))
                else:
                    batched["reason"] = f"not exact: {exact}/{n} prompts equal the per-prompt transformers tokens"
            except Exception as e:  # any failure means 'not supported' for this report
                batched["reason"] = f"error: {type(e).__name__}: {e}"[:500]
        results["transformers_batched"] = batched
    finally:
        if tmp is not None:
            tmp.cleanup()

    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"[bench] wrote {args.output_json}", file=sys.stderr)
    if batched["attempted"] and not batched["reported"]:
        print(f"[bench] transformers batched (left padding) not reported: {batched['reason']}")
    print(f"correctness: deepinfer greedy tokens equal transformers per-prompt tokens for {match}/{n} prompts")
    print(f"workload: {n} requests, {n_in} input + {sum(map(len, ours))} output tokens; torch threads {threads}")
    print("ratio column = deepinfer throughput / that system's throughput (>1: deepinfer faster)")
    print(format_table(rows))
    return 0 if match == n else 1


if __name__ == "__main__":
    sys.exit(main())

"""``deepinfer bench``: offline throughput on DeepInfer's default workload, scaled by flags.

DeepInfer's defaults: 64 requests of 32,768-token context of which the last 4,096 tokens are unique
to each request (the rest is a prefix shared by all), up to the given output length. ``--scale``
shrinks every length for small machines; ``--dataset random`` makes every prompt token unique.
Prints a summary table and writes JSON with the fields vLLM and SGLang emit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def make_prompts(n: int, context: int, suffix: int, dataset: str, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (max(context - suffix, 0),), generator=g).tolist()
    prompts = []
    for _ in range(n):
        if dataset == "random":
            prompts.append(torch.randint(3, vocab, (context,), generator=g).tolist())
        else:
            prompts.append([0] + shared[1:] + torch.randint(3, vocab, (min(suffix, context),), generator=g).tolist())
    return prompts


def run_bench(args: argparse.Namespace, llm, make_params) -> int:
    context = max(int(args.context * args.scale), 2)
    suffix = max(min(int(args.suffix * args.scale), context), 1)
    output_len = max(int((args.max_tokens or args.output_len) * args.scale), 1)
    context = min(context, llm.max_model_len - output_len)
    prompts = make_prompts(args.num_requests, context, suffix, args.dataset, llm.model.cfg.vocab_size, args.seed)
    args.max_tokens = output_len
    params = make_params(args, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    if llm.spec is not None:  # speculation statistics of the timed run only
        llm.spec.stats = type(llm.spec.stats)()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    ok = [o for o in outs if o.error is None]
    n_in = sum(len(o.prompt_token_ids) for o in ok)
    n_out = sum(len(c.token_ids) for o in ok for c in o.outputs)
    ttfts = sorted(o.metrics.time_to_first_token for o in ok if o.metrics and o.metrics.time_to_first_token)
    cached = sum(o.num_cached_tokens for o in ok)
    result = {
        "model": str(llm.model_path),
        "dataset": args.dataset,
        "num_requests": len(ok),
        "rejected": len(outs) - len(ok),
        "context_tokens": context,
        "uncached_suffix": suffix,
        "output_len": output_len,
        "elapsed_time": elapsed,
        "requests_per_second": len(ok) / elapsed,
        "input_tokens_per_second": n_in / elapsed,
        "output_tokens_per_second": n_out / elapsed,
        "tokens_per_second": (n_in + n_out) / elapsed,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "prefix_cache_hit_rate": cached / n_in if n_in else 0.0,
        "device": str(llm.device),
        "dtype": str(llm.model.dtype),
    }
    if llm.spec is not None:
        result["speculative_config"] = {
            "method": llm.spec.config.method,
            "num_speculative_tokens": llm.spec.config.num_speculative_tokens,
        }
        result.update(llm.spec.stats.as_dict())
    rows = [
        ("requests", f"{len(ok)} ({result['rejected']} rejected)"),
        ("context / suffix / output", f"{context} / {suffix} / {output_len}"),
        ("elapsed", f"{elapsed:.2f} s"),
        ("requests/s", f"{result['requests_per_second']:.3f}"),
        ("input tokens/s", f"{result['input_tokens_per_second']:,.1f}"),
        ("output tokens/s", f"{result['output_tokens_per_second']:,.1f}"),
        ("mean TTFT", f"{result['mean_ttft_s'] or 0:.3f} s"),
        ("prefix-cache hit rate", f"{result['prefix_cache_hit_rate']:.1%}"),
    ]
    if llm.spec is not None:
        rows.append(("mean accepted length", f"{result['spec_mean_accepted_length']:.2f}"))
        rows.append(("draft acceptance", f"{result['spec_acceptance_rate']:.1%}"))
    print("\n".join(f"{k:<28}{v}" for k, v in rows))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0

"""Speculative decoding: accepted length and speed-up over plain decoding, on the CPU or a GPU.

Three runs of the same decode-heavy workload (greedy, short prompts, long outputs) in one process:

* ``plain``: no speculation;
* ``dspark`` (or ``mtp`` with ``--method mtp``): the checkpoint's DSpark head (V4.1's, or V4-Flash-0731's with
  ``--arch v4-0731``; V4's MTP layer); with random weights its acceptance is meaningless, ~0;
* ``ceiling``: drafts forced to the target's greedy tokens (taken from the plain run), so every draft is
  accepted: the most speculation can give at this N on this machine.

Every run must produce the plain run's tokens (checked). Prints a table and writes JSON.

    python benchmarks/bench_spec_decode.py                      # tiny V4.1 on the CPU
    python benchmarks/bench_spec_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 8 64 --output-len 64
    python benchmarks/bench_spec_decode.py --method mtp --num-speculative-tokens 1   # tiny V4 with an MTP layer
    python benchmarks/bench_spec_decode.py --arch v4-0731       # tiny V4 with V4-Flash-0731's DSpark stages
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.llm import default_model_dir
from deepinfer_runtime.testing.scripted_proposer import ScriptedProposer


def _run(llm: LLM, prompts, params) -> tuple[list, float]:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    if llm.spec is not None:  # statistics of the timed run only
        llm.spec.stats = type(llm.spec.stats)()
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    return outs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="checkpoint directory (default: the built-in tiny V4.1, or a tiny V4)"
    )
    ap.add_argument("--method", default="dspark", choices=("dspark", "mtp"), help="the drafter under test")
    ap.add_argument(
        "--arch", default="v4.1", choices=("v4.1", "v4-0731"), help="dspark without --model: whose DSpark head"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--output-json", default="bench_spec_decode.json")
    args = ap.parse_args()
    if args.model:
        path = Path(args.model)
    elif args.method == "dspark" and args.arch == "v4.1":
        path = default_model_dir()
    else:  # a tiny random V4 with its MTP layer, or with V4-Flash-0731's DSpark stages
        from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

        head = (
            {"num_nextn_predict_layers": 1}
            if args.method == "mtp"
            else {"dspark_target_layer_ids": [2, 3, 4], "dspark_markov_rank": 16}
        )
        path = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / f"tiny-v4-{args.method}", "v4", config=head)
    n_spec = args.num_speculative_tokens
    spec = {"method": args.method, "num_speculative_tokens": n_spec}
    opts = dict(dtype=args.dtype, device=args.device, log_stats=False, kv_cache_memory=2 << 30)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llms = {"plain": LLM(model=path, **opts), args.method: LLM(model=path, speculative_config=spec, **opts)}
    llms["ceiling"] = LLM(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": n_spec}, **opts)
    results = []
    for bs in args.batch_sizes:
        g = torch.Generator().manual_seed(bs)
        vocab = llms["plain"].model.cfg.vocab_size
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(bs)]
        plain, t_plain = _run(llms["plain"], prompts, params)
        scripts = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain}
        llms["ceiling"].spec.proposer = ScriptedProposer(scripts, n_spec, vocab)
        for name in ("plain", args.method, "ceiling"):
            outs, t = (plain, t_plain) if name == "plain" else _run(llms[name], prompts, params)
            same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, plain))
            stats = llms[name].spec.stats.as_dict() if llms[name].spec is not None else {}
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            results.append(
                {
                    "batch_size": bs,
                    "run": name,
                    "elapsed_s": t,
                    "output_tokens_per_s": n_out / t,
                    "speedup_vs_plain": t_plain / t,
                    "same_tokens_as_plain": same,
                    **stats,
                }
            )
            if not same:
                raise SystemExit(f"{name} at batch {bs}: tokens differ from plain decoding")
    print(
        f"\nspeculative decoding, N={n_spec}, {args.device} {args.dtype}, prompt {args.prompt_len}, "
        f"output {args.output_len} ({path.name})"
    )
    print(f"{'batch':>5} {'run':>8} {'tok/s':>10} {'speed-up':>9} {'accepted len':>13} {'acceptance':>11}")
    for r in results:
        acc = r.get("spec_mean_accepted_length")
        rate = r.get("spec_acceptance_rate")
        print(
            f"{r['batch_size']:>5} {r['run']:>8} {r['output_tokens_per_s']:>10.1f} {r['speedup_vs_plain']:>8.2f}x "
            f"{'-' if acc is None else f'{acc:.2f}':>13} {'-' if rate is None else f'{rate:.1%}':>11}"
        )
    Path(args.output_json).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()

"""The ``deepinfer`` command line.

    deepinfer generate "Hello" "Once upon a time" [--model DIR] [--max-tokens 32] [--temperature 0]
    deepinfer generate --prompts-file prompts.jsonl          (JSONL with "prompt" fields, or plain text lines)
    echo "Hello" | deepinfer generate
    deepinfer chat [--model DIR]                             (interactive; /exit to quit, /reset to clear)
    deepinfer bench [--num-requests 64 --context 32768 --suffix 4096 ...] [--output-json out.json]

Without ``--model`` every command builds once (cached under ``$DEEPINFER_CACHE`` or ~/.cache/deepinfer) a
tiny random DeepSeek-V4.1-Flash checkpoint with the real tokenizer, and says so: its text is
meaningless, but every part of the engine runs for real.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer_runtime.errors import DeepInferError


def _engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="checkpoint directory (default: a cached tiny random V4.1 checkpoint)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--yoco-mode", choices=["off", "mask", "compact"], default=None)
    ap.add_argument("--yoco-keep-tokens", type=int, default=None)
    ap.add_argument(
        "--engram-device", default=None, help="V4.1: where the Engram tables live (default: host memory on a GPU)"
    )
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None, help="default: on CUDA")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no CUDA graphs (default on CUDA: decode steps, and the FFN sublayers of other short steps, replay CUDA "
        "graphs)",
    )
    ap.add_argument(
        "--speculative-config",
        type=_json_dict,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 5}\'',
    )
    par = ap.add_argument_group("parallelism (one process per rank; see deepinfer_runtime/distributed/README.md)")
    par.add_argument("--data-parallel-size", type=int, default=1)
    par.add_argument("--expert-parallel-size", type=int, default=None, help="1 or the DP size (default)")
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-min-tokens", type=int, default=None)
    par.add_argument("--enable-eplb", action="store_true")
    par.add_argument("--eplb-window-size", type=int, default=None)
    par.add_argument("--eplb-step-interval", type=int, default=None)
    par.add_argument("--num-redundant-experts", type=int, default=None)


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _sampling_args(ap: argparse.ArgumentParser, max_tokens: int = 32) -> None:
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--sampling-seed", type=int, default=None)


def _llm(args: argparse.Namespace):
    from deepinfer_runtime.llm import LLM

    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
        yoco_mode=args.yoco_mode,
        yoco_keep_tokens=args.yoco_keep_tokens,
        engram_device=args.engram_device,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        speculative_config=args.speculative_config,
        data_parallel_size=args.data_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
        context_parallel_size=args.context_parallel_size,
        context_parallel_min_tokens=args.context_parallel_min_tokens,
        enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size,
        eplb_step_interval=args.eplb_step_interval,
        num_redundant_experts=args.num_redundant_experts,
    )


def _params(args: argparse.Namespace, **extra):
    from deepinfer_runtime.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        **extra,
    )


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    lines = Path(args.prompts_file).read_text().splitlines() if args.prompts_file else sys.stdin.read().splitlines()
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DeepInferError(f"prompts line {n}: not a JSON object with a 'prompt' field") from None
        else:
            prompts.append(line)
    if not prompts:
        raise DeepInferError("no prompts: pass them as arguments, with --prompts-file, or on stdin")
    return prompts


def _generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    llm = _llm(args)
    outs = llm.generate(prompts, _params(args))
    for o in outs:
        if o.error:
            print(f"[{o.request_id}] error: {o.error}")
        else:
            c = o.outputs[0]
            print(f"[{o.request_id}] {o.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    history: list[dict] = []
    print("deepinfer chat: type a message; /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history.clear()
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        out = llm.chat(history, _params(args), thinking=args.thinking, use_tqdm=False)[0]
        text = out.outputs[0].text
        print(f"assistant> {text}")
        history.append({"role": "assistant", "content": text})
    return 0


def _bench(args: argparse.Namespace) -> int:
    from deepinfer_runtime.bench import run_bench

    return run_bench(args, _llm(args), _params)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer offline inference for DeepSeek V4 / V4.1")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts (arguments, --prompts-file, or stdin)")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--prompts-file", help="JSONL with a 'prompt' field per line, or one prompt per line")
    _engine_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    _engine_args(chat)
    _sampling_args(chat, max_tokens=256)
    chat.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None)
    bench = sub.add_parser("bench", help="offline throughput on random or shared-prefix prompts")
    _engine_args(bench)
    _sampling_args(bench, max_tokens=0)
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--context", type=int, default=32768, help="prompt tokens per request")
    bench.add_argument("--suffix", type=int, default=4096, help="uncached suffix per request (rest is shared)")
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--dataset", choices=["shared-prefix", "random"], default="shared-prefix")
    bench.add_argument("--scale", type=float, default=1.0, help="multiply context, suffix and output lengths")
    bench.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    try:
        return {"generate": _generate, "chat": _chat, "bench": _bench}[args.command](args)
    except (DeepInferError, ValueError, FileNotFoundError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

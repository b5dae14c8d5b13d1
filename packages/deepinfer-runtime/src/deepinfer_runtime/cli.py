"""The ``deepinfer`` command line.

    deepinfer generate "Hello" "Once upon a time" [--model DIR] [--max-tokens 32]

Without ``--model`` it builds (once, cached under ``$DEEPINFER_CACHE`` or ~/.cache/deepinfer) a
tiny random DeepSeek-V4-Flash checkpoint with the real tokenizer, and says so: the output text
is meaningless, but every part of loading and decoding runs for real.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from deepinfer_runtime.errors import DeepInferError


def default_model_dir() -> Path:
    """The cached tiny checkpoint, written on first use."""
    from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

    root = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))
    path = root / "tiny-v4-flash-fp8-fp4-seed0"
    if not (path / "config.json").exists():
        print(
            f"[deepinfer] no --model given: building a tiny random DeepSeek-V4-Flash checkpoint at {path}",
            file=sys.stderr,
        )
        write_tiny_checkpoint(path.with_suffix(".tmp"), "v4", "fp8+fp4", seed=0)
        path.with_suffix(".tmp").rename(path)
    else:
        print(f"[deepinfer] no --model given: using the tiny random checkpoint at {path}", file=sys.stderr)
    return path


def _generate(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer

    from deepinfer_runtime.model_loader import load_model

    prompts = list(args.prompts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise DeepInferError("no prompts: pass them as arguments or on stdin")
    if args.max_tokens < 1:
        raise DeepInferError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    path = Path(args.model) if args.model else default_model_dir()
    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise DeepInferError(f"{path}: no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_file))
    model = load_model(path, dtype=args.dtype)
    eos = model.cfg.eos_token_id
    total_new, start = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        if not ids:
            print(f"[{i}] error: prompt encodes to no tokens", file=sys.stderr)
            continue
        cache = model.new_cache()
        logits = model(torch.tensor([ids]), [cache])
        out: list[int] = []
        for _ in range(args.max_tokens):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            logits = model(torch.tensor([[nxt]]), [cache])
        total_new += len(out)
        print(f"[{i}] {prompt!r} -> {tokenizer.decode(out, skip_special_tokens=False)!r}")
    elapsed = time.perf_counter() - start
    print(
        f"\n{len(prompts)} prompt(s), {total_new} generated tokens in {elapsed:.2f} s "
        f"({total_new / max(elapsed, 1e-9):.1f} tok/s, greedy, reference ops on {args.dtype})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer offline inference for DeepSeek V4")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation for prompts (arguments or stdin)")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--model", help="checkpoint directory (default: a cached tiny random checkpoint)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    try:
        return _generate(args)
    except DeepInferError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

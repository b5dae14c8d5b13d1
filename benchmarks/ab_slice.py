"""Same-lease A/B of decode steps (issue 5): ``gpu_model_slice.py`` run once per variant per round, variants
alternating (A B A B ...), each a set of ``--set`` tuning overrides of one tree; then, per model, context and batch,
every run's pipelined ms and the mean per variant against the first variant.

Why: steps move 1-3% between leases and ~0.5% between runs of one lease, and the floor ratio moves with each run's
copy measurement, so only milliseconds of alternating runs in one lease compare (``benchmarks/README.md``).

    python benchmarks/ab_slice.py --variant base \\
        --variant "s4;deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES=4" \\
        --rounds 2 --contexts 4096,32768 --batches 1,8

A variant is ``NAME`` or ``NAME;MODULE.NAME=VALUE[;...]`` (``tuning_overrides.py``). Every run is
``gpu_model_slice.py --cuda-graphs --engram host --no-hf --no-invariance --prefill-budget-s 1 --steps STEPS`` with
the given models, contexts and batches, in a subprocess of its own (overrides do not leak between runs). Prints a
table last and writes ``$OUT/ab_slice.json`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME;SPEC;SPEC`` -> (NAME, [SPEC, ...]); the name must be non-empty and free of ';'."""
    name, *specs = [part.strip() for part in text.split(";")]
    if not name or "=" in name:
        raise ValueError(f"--variant {text!r}: expected NAME or NAME;MODULE.NAME=VALUE[;...]")
    return name, [s for s in specs if s]


def decode_rows(result: dict) -> list[dict]:
    """(model, context, batch, pipelined ms, x the floor at this run's copy rate) of one gpu_model_slice JSON."""
    return [
        {"model": model[:-5], "context": r["context"], "batch": r["batch"], "ms": r["pipelined_ms"],
         "x_floor": r["ratio_pipelined_as_run"], "copy_GBps": result["ceilings"]["copy_GBps"]}
        for model in ("v4_ours", "v41_ours")
        for r in result.get(model, {}).get("decode", [])
    ]  # fmt: skip


def summarize(runs: list[dict]) -> list[dict]:
    """Per (model, context, batch): each variant's mean pipelined ms over its rounds and its change against the
    first variant's mean, in the order the variants were given."""
    order = list(dict.fromkeys(r["variant"] for r in runs))
    keys = list(dict.fromkeys((r["model"], r["context"], r["batch"]) for r in runs))
    out = []
    for key in keys:
        means = {}
        for v in order:
            ms = [r["ms"] for r in runs if r["variant"] == v and (r["model"], r["context"], r["batch"]) == key]
            if ms:
                means[v] = statistics.mean(ms)
        base = means.get(order[0])
        for v, mean in means.items():
            out.append(
                {"model": key[0], "context": key[1], "batch": key[2], "variant": v, "mean_ms": mean,
                 "delta_us": None if base is None else (mean - base) * 1e3}
            )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME or NAME;MODULE.NAME=VALUE[;...]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default="v4,v4.1")
    p.add_argument("--contexts", default="4096")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--extra", default="", help="more gpu_model_slice.py arguments: --extra='--tiny --device cpu'")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / "ab_slice.json")
    args = p.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        p.error(str(exc))
    if len({name for name, _ in variants}) != len(variants):
        p.error("--variant names must differ")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for name, specs in variants:
            json_out = args.out.with_name(f"ab_slice_{name}_{rnd}.json")
            cmd = [
                sys.executable, str(HERE / "gpu_model_slice.py"), "--cuda-graphs", "--engram", "host", "--no-hf",
                "--no-invariance", "--prefill-budget-s", "1", "--steps", str(args.steps), "--models", args.models,
                "--contexts", args.contexts, "--batches", args.batches, "--out", str(json_out), *args.extra.split(),
            ]  # fmt: skip
            for spec in specs:
                cmd += ["--set", spec]
            print(f"[round {rnd + 1}/{args.rounds}] {name}: {' '.join(specs) or '(no overrides)'}", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"variant {name} round {rnd + 1} failed (exit {proc.returncode})")
            for row in decode_rows(json.loads(json_out.read_text())):
                runs.append({"variant": name, "round": rnd + 1, **row})
    summary = summarize(runs)
    result = {"variants": {n: s for n, s in variants}, "rounds": args.rounds, "runs": runs, "summary": summary}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{'variant':12} {'round':>5} {'model':5} {'ctx':>6} {'batch':>5} {'pipelined ms':>13} {'x floor':>8}")
    for r in runs:
        print(
            f"{r['variant']:12} {r['round']:5d} {r['model']:5} {r['context']:6d} {r['batch']:5d} {r['ms']:13.3f}"
            f" {r['x_floor']:7.3f}x"
        )
    print(f"\n{'model':5} {'ctx':>6} {'batch':>5} {'variant':12} {'mean ms':>9} {'vs first, us':>13}")
    for s in summary:
        print(
            f"{s['model']:5} {s['context']:6d} {s['batch']:5d} {s['variant']:12} {s['mean_ms']:9.3f}"
            f" {s['delta_us']:+13.1f}"
        )
    return result


if __name__ == "__main__":
    main()

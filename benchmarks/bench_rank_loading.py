"""What each rank of the parallel engine reads from the checkpoint (per-rank loading) vs the whole-model load.

Writes a tiny checkpoint (``testing/tiny_checkpoint.py``; ``--config`` JSON overrides its config, e.g. more
experts so the proportions look more like the release), then loads it once per (world, rank) in a fresh
process each (so peak RSS is that load's): world 1 is the single-process loader, world > 1 is
``load_model(..., shard=LoadShard(rank, world, ...))`` as the engine's ranks do. Prints bytes read split into
routed experts / Engram tables / everything else, load time and peak RSS (includes Python + torch, ~0.3 GiB)::

    python benchmarks/bench_rank_loading.py --arch v4.1 --quant fp8+fp4 --worlds 1 2 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch


def _load(path: str, world: int, rank: int, redundant: int) -> dict:
    from deepinfer_runtime import load_model
    from deepinfer_runtime.loader.shard import LoadShard

    torch.set_num_threads(1)
    shard = None if world == 1 else LoadShard(rank, world, True, redundant)
    st = load_model(path, dtype=torch.bfloat16, device="cpu", progress=False, shard=shard).load_stats
    experts = st.bytes_of(contains=".ffn.experts.")
    engram = st.bytes_of(contains=".engram.embed.")
    return dict(
        world=world,
        rank=rank,
        bytes_read=st.bytes_read,
        checkpoint_bytes=st.checkpoint_bytes,
        experts=experts,
        engram=engram,
        rest=st.bytes_read - experts - engram,
        seconds=st.seconds,
        peak_rss=st.peak_rss_bytes,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v4.1", choices=["v4", "v4.1"])
    ap.add_argument("--quant", default="fp8+fp4")
    ap.add_argument("--config", type=json.loads, default=None, help="JSON overrides of the tiny config")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--redundant", type=int, default=0, help="redundant expert slots per layer (EP)")
    args = ap.parse_args()

    from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(Path(tmp) / "ckpt", args.arch, args.quant, seed=0, config=args.config)
        rows = []
        for world in args.worlds:
            for rank in range(world):
                # one fresh process per load: ru_maxrss is then that load's peak
                with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                    rows.append(pool.submit(_load, str(path), world, rank, args.redundant).result())
    mib = 1 << 20
    print(
        f"\n{args.arch} {args.quant} {args.config or ''}: checkpoint files {rows[0]['checkpoint_bytes'] / mib:.1f} MiB"
    )
    print(
        f"{'world':>5} {'rank':>4} {'read MiB':>9} {'experts':>8} {'engram':>8} {'rest':>8} {'of whole':>8} "
        f"{'load s':>7} {'peak RSS MiB':>12}"
    )
    whole = next((r["bytes_read"] for r in rows if r["world"] == 1), rows[0]["checkpoint_bytes"])
    for r in rows:
        print(
            f"{r['world']:>5} {r['rank']:>4} {r['bytes_read'] / mib:>9.1f} {r['experts'] / mib:>8.1f} "
            f"{r['engram'] / mib:>8.1f} {r['rest'] / mib:>8.1f} {r['bytes_read'] / whole:>8.3f} "
            f"{r['seconds']:>7.2f} {r['peak_rss'] / mib:>12.0f}"
        )


if __name__ == "__main__":
    main()

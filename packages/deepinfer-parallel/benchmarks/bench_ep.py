"""Expert-parallel dispatch/combine bandwidth and one MoE layer's time at EP = world vs EP = 1.

Runs ``world`` ranks through ``deepinfer_parallel.WorkerGroup`` (gloo on CPU, NCCL on GPUs)::

    python packages/deepinfer-parallel/benchmarks/bench_ep.py                          # gloo, 2 ranks, small
    python packages/deepinfer-parallel/benchmarks/bench_ep.py --backend nccl --preset v41  # 2 GPUs, V4.1 shapes

Measured per rank, reported as the max over ranks (the step waits for the slowest):

- ``dispatch+combine``: ``ep_dispatch`` + ``ep_combine`` with a trivial expert (y = w * x), in both combine modes;
  "off-rank GB/s" = bytes this rank sends to *other* ranks (token rows, pair metadata, returned rows) / time.
- ``moe layer``: routed experts + shared expert for the rank's tokens: EP = world (``ep_moe``, experts sharded,
  ``--redundant`` extra replicas planned by EPLB from the routed load) vs EP = 1 (every rank holds all experts and
  runs its own tokens, no communication). Expert math: ``--experts torch`` (one F.linear per hit expert, the fast
  plain-PyTorch path) or ``reference`` (the kernels' ``moe_experts`` reference; slow, bitwise-exact path).

Prints a table and writes JSON to <repo>/benchmarks/results/bench_ep_<backend>_w<world>_<time>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepinfer_kernels.ops.moe import moe_experts, moe_route_topk, swiglu_mlp
from deepinfer_parallel import WorkerGroup, ep_combine, ep_dispatch, ep_moe, rebalance_experts, swiglu_expert_fn
from deepinfer_parallel.ep import choose_replicas

PRESETS = {
    # tokens per rank, hidden, routed experts, top-k, moe intermediate
    "small": dict(tokens=512, hidden=1024, experts=32, top_k=4, inter=512),
    "v41": dict(tokens=4096, hidden=5120, experts=384, top_k=6, inter=2304),
    "v4": dict(tokens=4096, hidden=4096, experts=256, top_k=6, inter=2048),
}


def _sync(ctx):
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(value: float, ctx) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timeit(ctx, fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(ctx)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(ctx)
    return _max_over_ranks((time.perf_counter() - t0) / iters, ctx)


def torch_expert_fn(w13: torch.Tensor, w2: torch.Tensor, limit: float):
    """Per-pair weighted SwiGLU expert outputs with one plain F.linear per hit slot ([N, d] fp32)."""
    inter = w2.shape[2]

    def run(x, slot, weight):
        out = torch.empty((x.shape[0], w2.shape[1]), dtype=torch.float32, device=x.device)
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot, minlength=w13.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            start += n
            gu = F.linear(x[idx], w13[e]).float()
            h = F.silu(gu[:, :inter].clamp(max=limit)) * gu[:, inter:].clamp(-limit, limit)
            out[idx] = F.linear((h * weight[idx, None]).to(w2.dtype), w2[e]).float()
        return out

    return run


def bench_rank(ctx, cfg: dict) -> dict:
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    dev, dtype = ctx.device, getattr(torch, cfg["dtype"])
    d, e, k, inter, t = cfg["hidden"], cfg["experts"], cfg["top_k"], cfg["inter"], cfg["tokens"]
    world, rank = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(e, d, generator=g).to(dev)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * d**-0.5).to(dtype).to(dev)
    w2 = (torch.randn(e, d, inter, generator=g) * inter**-0.5).to(dtype).to(dev)
    sw = [(torch.randn(*s, generator=g) * 0.02).to(dtype).to(dev) for s in ((inter, d), (inter, d), (d, inter))]
    gx = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(t, d, generator=gx).to(dtype).to(dev)
    bias = torch.linspace(1.0, -1.0, e, device=dev) * cfg["skew"]  # a skewed router: some experts are hot
    weights, experts = moe_route_topk(x.float() @ gate.T.float(), bias, k, route_scale=1.5)

    load = torch.bincount(experts.flatten().cpu(), minlength=e).to(dev)
    dist.all_reduce(load)
    placement = rebalance_experts(load.cpu(), e + cfg["redundant"], world)
    local = placement.local_logical(rank).to(dev)
    limit = 10.0
    if cfg["experts_impl"] == "reference":
        ep_fn = swiglu_expert_fn(w13[local], w2[local], swiglu_limit=limit)

        def full_fn():
            return moe_experts(x, experts, weights, w13, w2, swiglu_limit=limit)
    else:
        ep_fn = torch_expert_fn(w13[local], w2[local], limit)
        all_fn = torch_expert_fn(w13, w2, limit)

        def full_fn():
            y = all_fn(x.repeat_interleave(k, 0), experts.reshape(-1), weights.reshape(-1))
            return y.view(t, k, d).sum(1).to(dtype)

    def shared(v):
        return swiglu_mlp(v, *sw, swiglu_limit=limit) if cfg["experts_impl"] == "reference" else _torch_shared(v, sw)

    # off-rank bytes of one dispatch + combine (from the dispatch plan)
    phys = choose_replicas(experts.cpu(), placement, rank)
    dst = placement.rank_of_slot(phys)
    hit = torch.zeros(t, world, dtype=torch.bool)
    hit[torch.arange(t)[:, None].expand(t, k), dst] = True
    remote_rows = int(hit.sum()) - int(hit[:, rank].sum())
    remote_pairs = int((dst != rank).sum())
    itemsize = x.element_size()
    dispatch_bytes = remote_rows * d * itemsize + remote_pairs * 3 * 8
    combine_bytes = {"exact": remote_pairs * d * 4, "reduced": remote_rows * d * itemsize}

    res = {"rank": rank, "remote_rows": remote_rows, "remote_pairs": remote_pairs}
    for mode in ("exact", "reduced"):

        def comm(mode=mode):
            h = ep_dispatch(x, experts, weights, placement)
            y = h.recv_x[h.recv_row].float() * h.recv_weight[:, None]
            return ep_combine(y, h, combine=mode)

        s = _timeit(ctx, comm, cfg["warmup"], cfg["iters"])
        nbytes = _max_over_ranks(float(dispatch_bytes + combine_bytes[mode]), ctx)
        res[f"comm_{mode}_s"] = s
        res[f"comm_{mode}_gbps"] = nbytes / s / 1e9
        res[f"comm_{mode}_bytes"] = nbytes

    res["moe_ep_s"] = _timeit(
        ctx, lambda: ep_moe(x, experts, weights, placement, ep_fn, shared_fn=shared), cfg["warmup"], cfg["iters"]
    )
    res["moe_ep1_s"] = _timeit(ctx, lambda: full_fn() + shared(x), cfg["warmup"], cfg["iters"])
    res["placement_imbalance"] = placement.imbalance(load.cpu())
    return res


def _torch_shared(v, sw):
    w1, w3, w2 = sw
    h = F.silu(F.linear(v, w1).float().clamp(max=10.0)) * F.linear(v, w3).float().clamp(-10.0, 10.0)
    return F.linear(h.to(v.dtype), w2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="shapes (default: small on gloo, v41 on nccl)"
    )
    for name in ("tokens", "hidden", "experts", "top_k", "inter"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--redundant", type=int, default=0, help="EPLB redundant experts (multiple of world helps)")
    ap.add_argument("--skew", type=float, default=2.0, help="router bias spread (0 = unskewed)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--experts-impl", choices=["torch", "reference"], default="torch")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: 1 on gloo)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[3] / "benchmarks" / "results")
    args = ap.parse_args()

    cfg = dict(PRESETS[args.preset or ("v41" if args.backend == "nccl" else "small")])
    for name in ("tokens", "hidden", "experts", "top_k", "inter"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    cfg.update(
        redundant=args.redundant,
        skew=args.skew,
        dtype=args.dtype,
        experts_impl=args.experts_impl,
        warmup=args.warmup,
        iters=args.iters,
        threads=args.threads if args.threads is not None else (1 if args.backend == "gloo" else 0),
    )
    if (cfg["experts"] + cfg["redundant"]) % args.world:
        raise SystemExit(f"experts + redundant = {cfg['experts'] + cfg['redundant']} must divide over {args.world}")

    with WorkerGroup(args.world, backend=args.backend, call_timeout_s=1800, collective_timeout_s=1800) as group:
        per_rank = group.call(bench_rank, cfg)
    worst = {key: max(r[key] for r in per_rank) for key in per_rank[0] if key != "rank"}

    print(f"\nEP benchmark: backend={args.backend} world={args.world} {cfg}")
    print(f"{'measure':<34}{'value':>14}")
    rows = [
        ("dispatch+combine exact [ms]", worst["comm_exact_s"] * 1e3),
        ("  off-rank GB/s (exact)", min(r["comm_exact_gbps"] for r in per_rank)),
        ("dispatch+combine reduced [ms]", worst["comm_reduced_s"] * 1e3),
        ("  off-rank GB/s (reduced)", min(r["comm_reduced_gbps"] for r in per_rank)),
        (f"moe layer EP={args.world} [ms]", worst["moe_ep_s"] * 1e3),
        ("moe layer EP=1 [ms]", worst["moe_ep1_s"] * 1e3),
        ("EPLB rank max/mean load", worst["placement_imbalance"]),
    ]
    for name, value in rows:
        print(f"{name:<34}{value:>14.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_ep_{args.backend}_w{args.world}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {
        "config": cfg,
        "backend": args.backend,
        "world": args.world,
        "host": platform.node(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if args.backend == "nccl" else platform.processor() or "cpu",
        "per_rank": per_rank,
        "summary": {name.strip(): value for name, value in rows},
    }
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

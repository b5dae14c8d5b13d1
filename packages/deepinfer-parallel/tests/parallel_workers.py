"""Worker functions the tests run inside spawned ranks (module-level, so they pickle by reference). Each returns
data for the test process to assert on; none asserts by itself."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from deepinfer_kernels.ops.moe import moe_experts, moe_route_topk, swiglu_mlp
from deepinfer_parallel import (
    LoadRecorder,
    cp_gather,
    cp_scatter,
    ep_moe,
    exchange_expert_weights,
    gather_rows,
    plan_moves,
    rebalance_experts,
    shard_rows,
    swiglu_expert_fn,
    vocab_parallel_embedding,
    vocab_parallel_logits,
    zigzag_assignment,
)
from deepinfer_parallel.ep import choose_replicas


def make_subgroups(ctx, sizes: list[int]):
    """Collective on every rank: sub-groups of the *last* n ranks (tests at world n inside a larger group; group
    ranks then differ from global ranks, which exercises the group-rank mapping)."""
    for n in sizes:
        group = dist.new_group(list(range(ctx.world_size - n, ctx.world_size)))
        if ctx.rank >= ctx.world_size - n:
            ctx.state[f"group{n}"] = group
    return True


def _member(ctx, world: int):
    """(is member, group, rank in that group) for a test at ``world`` ranks run on the last ``world`` ranks."""
    if world == ctx.world_size:
        return True, None, ctx.rank
    first = ctx.world_size - world
    if ctx.rank < first:
        return False, None, ctx.rank
    return True, ctx.state[f"group{world}"], ctx.rank - first


def moe_setup(seed: int, num_experts: int, d: int, inter: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, d, generator=g) * 0.2
    w2 = torch.randn(num_experts, d, inter, generator=g) * 0.2
    sw1 = torch.randn(inter, d, generator=g) * 0.2
    sw3 = torch.randn(inter, d, generator=g) * 0.2
    sw2 = torch.randn(d, inter, generator=g) * 0.2
    gate = torch.randn(num_experts, d, generator=g)
    return w13, w2, sw1, sw3, sw2, gate


def rank_tokens(seed: int, rank: int, num_tokens: int, d: int, dtype: torch.dtype, gate: torch.Tensor, top_k: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(num_tokens, d, generator=g) * 2).to(dtype)
    # skew the router so some experts are hot (replicas matter)
    logits = x.float() @ gate.T + torch.linspace(2.0, -2.0, gate.shape[0])
    weights, experts = moe_route_topk(logits, None, top_k, route_scale=1.5)
    return x, experts, weights


def ep_vs_reference(
    ctx,
    world: int,
    seed: int,
    num_experts: int,
    num_redundant: int,
    top_k: int,
    d: int,
    inter: int,
    tokens_per_rank: list[int],
    dtype: torch.dtype,
    combine: str,
):
    """Run ep_moe on this rank's tokens and the single-process reference; return both outputs and how many pairs
    went to another rank."""
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    w13, w2, sw1, sw3, sw2, gate = moe_setup(seed, num_experts, d, inter)
    load = torch.linspace(10.0, 1.0, num_experts) ** 3  # same on every rank
    placement = rebalance_experts(load, num_experts + num_redundant, world)
    local = placement.local_logical(rank)
    expert_fn = swiglu_expert_fn(w13[local], w2[local], swiglu_limit=10.0)
    x, experts, weights = rank_tokens(seed, rank, tokens_per_rank[rank], d, dtype, gate, top_k)

    def shared(v):
        return swiglu_mlp(v, sw1, sw3, sw2, swiglu_limit=10.0)

    out = ep_moe(x, experts, weights, placement, expert_fn, group, shared_fn=shared, combine=combine)
    ref = moe_experts(x, experts, weights, w13, w2, swiglu_limit=10.0) + shared(x)
    remote = int((placement.rank_of_slot(choose_replicas(experts, placement, rank)) != rank).sum())
    return out, ref, remote


def deep_ep_vs_reference(
    ctx, world: int, seed: int, num_experts: int, num_redundant: int, top_k: int, d: int, tokens_per_rank: list[int]
):
    """deep_ep_moe through the fake DeepEP Buffer (bf16) and the single-process reference on this rank's tokens;
    returns both outputs and the Buffer calls made."""
    from deepinfer_parallel import fake_deep_ep
    from deepinfer_parallel.deep_ep_adapter import DeepEPDispatcher, deep_ep_moe

    member, group, rank = _member(ctx, world)
    if not member:
        return None
    w13, w2, _, _, _, gate = moe_setup(seed, num_experts, d, 16)
    w13, w2 = w13.bfloat16(), w2.bfloat16()
    load = torch.linspace(10.0, 1.0, num_experts) ** 3
    placement = rebalance_experts(load, num_experts + num_redundant, world)
    local = placement.local_logical(rank)
    x, experts, weights = rank_tokens(seed, rank, tokens_per_rank[rank], d, torch.bfloat16, gate, top_k)
    dispatcher = DeepEPDispatcher(group, d * 2, deep_ep=fake_deep_ep)
    fn = swiglu_expert_fn(w13[local], w2[local], swiglu_limit=10.0)
    out = deep_ep_moe(x, experts, weights, placement, fn, dispatcher)
    ref = moe_experts(x, experts, weights, w13, w2, swiglu_limit=10.0)
    return out, ref, dict(dispatcher.buffer.calls)


def cp_round_trip(ctx, world: int, seq_len: int, align: int, dtype: torch.dtype):
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    a = zigzag_assignment(seq_len, world, align=align)
    full = (torch.randn(seq_len, 3, 2, generator=torch.Generator().manual_seed(seq_len)) * 3).to(dtype)
    local = cp_scatter(full, a, rank)
    return full, cp_gather(local, a, group), local.shape[0]


def rows_gather(ctx, world: int, num_rows: int, width: int, num_ids: list[int]):
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    g = torch.Generator().manual_seed(num_rows)
    # the Engram table's stored formats: FP8 E4M3 rows, UE8M0 scales (index_put has no kernel for the latter)
    table = torch.randint(0, 256, (num_rows, width), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scales = torch.randint(0, 255, (num_rows, 8), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    ids = torch.randint(0, num_rows, (num_ids[rank],), generator=torch.Generator().manual_seed(rank))
    got = gather_rows(shard_rows(table, world, rank), ids, num_rows, group)
    got_scales = gather_rows(shard_rows(scales, world, rank), ids, num_rows, group)
    same = [
        g.dtype == t.dtype and torch.equal(g.view(torch.uint8), t[ids].view(torch.uint8))
        for g, t in ((got, table), (got_scales, scales))
    ]
    return same[0], same[1], ids.numel()


def vocab_layers(ctx, world: int, vocab: int, d: int, tokens_per_rank: list[int]):
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    g = torch.Generator().manual_seed(vocab)
    embed = torch.randn(vocab, d, generator=g).to(torch.bfloat16)
    head = torch.randn(vocab, d, generator=g).to(torch.bfloat16)
    t = tokens_per_rank[rank]
    ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(rank))
    hidden = torch.randn(t, d, generator=torch.Generator().manual_seed(100 + rank))
    emb = vocab_parallel_embedding(ids, shard_rows(embed, world, rank), vocab, group)
    logits = vocab_parallel_logits(hidden, shard_rows(head, world, rank), vocab, group)
    return emb, embed[ids], logits, hidden.float() @ head.float().T


def weight_exchange(ctx, world: int, num_experts: int, num_redundant: int):
    """Old placement from one load, new from another; move real tensors; return (got, expected) local weights."""
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(num_experts, 6, 4, generator=g)
    w2 = torch.randn(num_experts, 4, 3, generator=g).to(torch.bfloat16)
    p = num_experts + num_redundant
    old = rebalance_experts(torch.rand(num_experts, generator=g) ** 4, p, world)
    new = rebalance_experts(torch.rand(num_experts, generator=g) ** 4, p, world)
    moves = plan_moves(old, new)
    lo = old.local_logical(rank)
    got = exchange_expert_weights([w13[lo], w2[lo]], moves, old.slots_per_rank, group)
    ln = new.local_logical(rank)
    remote = sum(m.src_rank != m.dst_rank for m in moves)
    return got, [w13[ln], w2[ln]], remote


def recorder_global(ctx, world: int, num_layers: int, num_experts: int):
    member, group, rank = _member(ctx, world)
    if not member:
        return None
    rec = LoadRecorder(num_layers, num_experts, window_size=4, step_interval=8)
    g = torch.Generator().manual_seed(rank)
    local = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    for _ in range(3):
        for layer in range(num_layers):
            ids = torch.randint(0, num_experts, (5, 2), generator=g)
            rec.record(layer, ids)
            local[layer] += torch.bincount(ids.flatten(), minlength=num_experts)
        rec.step()
    return local, rec.global_load(group)


def barrier_after_sleep(ctx, sleeping_rank: int, seconds: float):
    if ctx.rank == sleeping_rank:
        time.sleep(seconds)
    dist.barrier()
    return ctx.rank


def kill_self(ctx, rank: int):
    if ctx.rank == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return ctx.rank


def raise_on(ctx, rank: int):
    if ctx.rank == rank:
        raise RuntimeError("boom from a worker")
    return ctx.rank


def whoami(ctx):
    return ctx.rank, ctx.world_size, os.getpid()

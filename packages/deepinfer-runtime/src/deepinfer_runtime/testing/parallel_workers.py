"""Functions that tests run inside spawned ranks (``deepinfer_parallel.WorkerGroup`` pickles them by reference,
so they live in an importable module). Each returns data for the test process to check."""

from __future__ import annotations

import torch


def scale_routed_experts(model, factor: float) -> None:
    """Multiply every backbone layer's routed expert weights ``w13`` by ``factor`` (pushes SwiGLU inputs past
    the clamp, so that a wrong ``swiglu_limit`` shows)."""
    for block in model.layers:
        block.ffn.experts.w13.data.mul_(factor)


def ep_forward_one_busy_rank(ctx, path: str, prompt: list[int], factor: float, busy_rank: int):
    """Every rank loads the model, scales its experts and shards them (EP over all ranks). ``busy_rank`` runs a
    full forward of ``prompt``; the others only join the collectives with empty calls (a rank with nothing to
    run), yet compute the tokens sent to their experts. Returns the busy rank's logits [S, V], else None."""
    from deepinfer_runtime.distributed.ep_experts import install_expert_parallel
    from deepinfer_runtime.distributed.sites import CollectiveSites
    from deepinfer_runtime.model_loader import load_model

    torch.set_num_threads(1)
    model = load_model(path, dtype=torch.float32, device="cpu", progress=False)
    scale_routed_experts(model, factor)
    sites = CollectiveSites()
    ep = install_expert_parallel(model, ctx.rank, ctx.world_size, sites)
    sites.sites.extend(ep.layers)
    if ctx.rank != busy_rank:
        sites.dummy_pass()
        return None
    return model.forward_logits(torch.tensor([prompt]))[0]


def ep_forward_fake_deep_ep(ctx, path: str, prompt: list[int]):
    """Every rank loads its share of the checkpoint (bf16), installs EP with a ``DeepEPDispatcher`` over
    ``deepinfer_parallel.fake_deep_ep`` and runs a forward of ``prompt``. Returns (logits [S, V], the fake
    Buffer's call counts)."""
    from deepinfer_parallel import fake_deep_ep
    from deepinfer_parallel.deep_ep_adapter import DeepEPDispatcher

    from deepinfer_runtime.distributed.ep_experts import install_expert_parallel
    from deepinfer_runtime.distributed.sites import CollectiveSites
    from deepinfer_runtime.loader.shard import LoadShard
    from deepinfer_runtime.model_loader import load_model

    torch.set_num_threads(1)
    shard = LoadShard(ctx.rank, ctx.world_size)
    model = load_model(path, dtype=torch.bfloat16, device="cpu", progress=False, shard=shard)
    dispatcher = DeepEPDispatcher(None, model.cfg.hidden_size * 2, deep_ep=fake_deep_ep)
    install_expert_parallel(model, ctx.rank, ctx.world_size, CollectiveSites(), dispatcher=dispatcher)
    return model.forward_logits(torch.tensor([prompt]))[0], dict(dispatcher.buffer.calls)

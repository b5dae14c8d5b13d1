"""What runs inside each rank (spawned by ``deepinfer_parallel.WorkerGroup``; functions are module-level so that
they pickle by reference).

A rank is a complete single-process engine (``LLM`` with its scheduler, runner and KV pools) over the requests
the driver assigns it, whose MoE layers are expert-parallel over all ranks. ``rank_step`` is one lockstep
iteration: add the new requests, run the CP prefills of this step (or join them with empty MoE calls), run one
engine step (or, with nothing to run, an empty pass through the EP collectives), close the EPLB step.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepinfer_parallel import RankContext

from deepinfer_runtime.distributed.config import ParallelConfig
from deepinfer_runtime.distributed.engram_shard import install_engram_sharding
from deepinfer_runtime.distributed.ep_experts import ExpertParallel, install_expert_parallel
from deepinfer_runtime.distributed.eplb_live import LiveEplb
from deepinfer_runtime.distributed.messages import CPJob, ModelView, RankInfo, RequestUpdate, StepReport
from deepinfer_runtime.distributed.sites import CollectiveSites
from deepinfer_runtime.engine.request import Request
from deepinfer_runtime.loader.shard import LoadShard


@dataclass
class RankState:
    """Per-rank state kept between commands (``ctx.state["engine"]``)."""

    llm: object  # deepinfer_runtime.llm.LLM, single process
    config: ParallelConfig
    sites: CollectiveSites  # the model's collective layers (EP MoE, sharded Engram), forward order
    ep: ExpertParallel | None
    eplb: LiveEplb | None
    cp_group: dist.ProcessGroup | None  # this rank's CP group (None: CP off)


def init_rank(ctx: RankContext, llm_kwargs: dict, config: ParallelConfig) -> RankInfo:
    """Build this rank's engine from its share of the checkpoint (``LoadShard``: its expert slots, its Engram
    rows) and install EP and the Engram sharding over it. Collective (CP sub-groups are created on every rank)."""
    from deepinfer_runtime.llm import LLM

    if ctx.device.type == "cpu":  # ranks share the host's cores: oversubscribed OpenMP threads spin and crawl
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    ep_on = config.expert_parallel_size > 1
    shard = LoadShard(ctx.rank, ctx.world_size, ep_on, config.num_redundant_experts if ep_on else 0)
    kwargs = dict(llm_kwargs, device=str(ctx.device), load_shard=shard)
    if ctx.rank:
        kwargs["log_stats"] = False
    llm = LLM(**kwargs)
    sites = CollectiveSites()
    ep = eplb = None
    if ep_on:
        dispatcher = _dispatcher(ctx, llm, config)
        ep = install_expert_parallel(
            llm.model, ctx.rank, ctx.world_size, sites, config.num_redundant_experts, dispatcher=dispatcher
        )
        if config.eplb is not None:
            eplb = LiveEplb(ep, config.eplb, ctx.world_size)
    engram = install_engram_sharding(llm.model, ctx.rank, ctx.world_size, sites)
    for index in range(len(llm.model.layers)):  # forward order: a block's Engram lookup, then its MoE
        if index in engram:
            sites.sites.append(engram[index])
        if ep is not None:
            sites.sites.append(ep.layers[index])
    cp_group = None
    if config.context_parallel_size > 1:
        for g in range(config.num_cp_groups):  # new_group is collective: every rank creates every group
            group = dist.new_group(config.cp_ranks(g))
            if config.cp_group_of(ctx.rank) == g:
                cp_group = group
    ctx.state["engine"] = RankState(llm, config, sites, ep, eplb, cp_group)
    model = llm.model
    view = ModelView(model.cfg, getattr(model, "yoco_mode", "off"), model.dtype)
    return RankInfo(view, llm.budget, llm.max_model_len, set(llm.eos), ep.num_layers if ep else 0, model.load_stats)


def _dispatcher(ctx: RankContext, llm, config: ParallelConfig):
    """A ``DeepEPDispatcher`` when ``ep_backend`` is "deep_ep" and DeepEP can run here (else None: all-to-all)."""
    from deepinfer_parallel.deep_ep_adapter import DeepEPDispatcher, select_ep_backend

    def log(message: str) -> None:  # every rank decides alike; one line is enough
        if ctx.rank == 0:
            print(message, file=sys.stderr)

    if select_ep_backend(config.ep_backend, ctx.device.type, dist.get_backend(), log) != "deep_ep":
        return None
    if llm.model.dtype != torch.bfloat16:
        log(f"[deepinfer] EP backend deep_ep needs a bfloat16 model (here {llm.model.dtype}); using all_to_all")
        return None
    hidden_bytes = llm.model.cfg.hidden_size * llm.model.dtype.itemsize
    return DeepEPDispatcher(None, hidden_bytes)


@torch.no_grad()
def rank_step(ctx: RankContext, new_requests: list[Request], cp_jobs: list[CPJob]) -> StepReport:
    """One lockstep engine iteration on this rank; see the module docstring."""
    st: RankState = ctx.state["engine"]
    engine = st.llm.engine
    report = StepReport()
    for req in new_requests:
        engine.add_request(req)
        if req.finished:  # refused at admission (e.g. a grammar that does not compile)
            report.finished.append(RequestUpdate.of(req))
    if cp_jobs:
        from deepinfer_runtime.distributed.cp_prefill import run_cp_phase

        taken, prefilled = run_cp_phase(st, ctx.rank, cp_jobs)
        for req in taken:
            if prefilled:
                report.cp_prefilled.append(req.request_id)
            else:
                report.cp_fallbacks += 1
            if req.finished:
                report.finished.append(RequestUpdate.of(req))
        st.sites.reset()  # the CP phase made its own complete round of collective calls on every rank
    steps_before = engine.num_steps
    if engine.has_unfinished:
        report.finished += [RequestUpdate.of(r) for r in engine.step()]
    report.ran_forward = engine.num_steps > steps_before
    st.sites.finish_step()
    if st.eplb is not None:
        st.eplb.end_step()
        report.eplb_rearrangements = st.eplb.stats.rearrangements
        report.eplb_moved_slots = st.eplb.stats.moved_slots
    return report


def rank_placements(ctx: RankContext) -> list[list[int]]:
    """This rank's current expert placement per EP layer (``phy2log`` lists; tests and diagnostics)."""
    st: RankState = ctx.state["engine"]
    return [p.phy2log.tolist() for p in st.ep.placements()] if st.ep is not None else []

"""The driver side of multi-process serving: ``ParallelEngine`` stands where ``LLMEngine`` stands in a
single-process ``LLM`` (same ``add_request`` / ``step`` / ``has_unfinished`` / ``num_steps``), but every step
is one lockstep iteration of all ranks (``rank.rank_step``).

Requests go to the attention-DP rank with the fewest tokens in flight (prompt + max new tokens, capped by
``max_model_len``), via ``deepinfer_parallel.DPBalancer``. A long prompt (>= ``cp_min_tokens``) with CP on is
prefilled by the CP group of its owner rank (one CP prefill per group per step). A rank that dies, hangs or
raises ends the engine with ``deepinfer_parallel.ParallelError``; the launcher has then already stopped and
reaped every rank.
"""

from __future__ import annotations

import atexit
import json
import sys
from collections import deque
from pathlib import Path

from deepinfer_parallel import DPBalancer, WorkerGroup

from deepinfer_runtime.distributed.config import ParallelConfig
from deepinfer_runtime.distributed.messages import CPJob, RankInfo
from deepinfer_runtime.distributed.rank import init_rank, rank_placements, rank_step
from deepinfer_runtime.engine.request import Request
from deepinfer_runtime.loader.shard import LoadStats, expert_placement


class ParallelEngine:
    """Drives ``config.world_size`` ranks in lockstep.

    Attributes:
        num_steps: lockstep iterations so far.
        eplb_rearrangements / eplb_moved_slots: EPLB totals reported by the ranks.
        cp_prefills: requests prefilled with context parallelism.
        cp_fallbacks: CP requests whose owner had no free KV blocks; they were prefilled the ordinary way.
        load_stats: per rank, what its loader read from the checkpoint (``LoadStats``).
    """

    def __init__(self, group: WorkerGroup, config: ParallelConfig, infos: list[RankInfo]):
        info = infos[0]
        self.group, self.config, self.info = group, config, info
        self.load_stats: list[LoadStats] = [i.load for i in infos]
        self.balancer = DPBalancer(config.world_size)
        self._live: dict[str, Request] = {}
        self._new: list[Request] = []
        self._cp_waiting: deque[Request] = deque()
        self.num_steps = 0
        self.eplb_rearrangements = 0
        self.eplb_moved_slots = 0
        self.cp_prefills = 0
        self.cp_fallbacks = 0

    def add_request(self, req: Request) -> None:
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id!r} is already running")
        self._live[req.request_id] = req
        self._new.append(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    def _weight(self, req: Request) -> int:
        """Tokens in flight a request adds to its rank: prompt + output, as far as the rank must hold them."""
        out = req.params.max_tokens if req.params.max_tokens is not None else self.info.max_model_len
        return min(req.num_prompt_tokens + out, self.info.max_model_len)

    def _wants_cp(self, req: Request) -> bool:
        # prompt logprobs need every prompt row's logits, which the CP prefill does not produce
        return (
            self.config.context_parallel_size > 1
            and req.num_prompt_tokens >= self.config.cp_min_tokens
            and req.params.prompt_logprobs is None
        )

    def step(self) -> list[Request]:
        """One lockstep iteration of every rank; returns the (driver-side) requests that finished in it."""
        world = self.config.world_size
        adds: list[list[Request]] = [[] for _ in range(world)]
        for req in self._new:
            if self._wants_cp(req):
                self._cp_waiting.append(req)
            else:
                adds[self.balancer.add(req.request_id, self._weight(req))].append(req)
        self._new = []
        jobs: list[CPJob] = []
        free = set(range(self.config.num_cp_groups))
        while self._cp_waiting and free:  # one CP prefill per CP group per step
            req = self._cp_waiting.popleft()
            allowed = [r for g in sorted(free) for r in self.config.cp_ranks(g)]
            owner = self.balancer.add(req.request_id, self._weight(req), allowed=allowed)
            free.discard(self.config.cp_group_of(owner))
            jobs.append(CPJob(owner, req))
        reports = self.group.call(
            rank_step, rank_args=[(adds[r], jobs) for r in range(world)], timeout_s=self.config.step_timeout_s
        )
        self.num_steps += 1
        finished = []
        for report in reports:
            self.cp_prefills += len(report.cp_prefilled)
            self.cp_fallbacks += report.cp_fallbacks
            for update in report.finished:
                req = self._live.pop(update.request_id)
                update.apply(req)
                self.balancer.finish(req.request_id)
                finished.append(req)
        self.eplb_rearrangements = reports[0].eplb_rearrangements
        self.eplb_moved_slots = reports[0].eplb_moved_slots
        return finished

    def placements(self) -> list[list[list[int]]]:
        """Per rank, per EP layer, the current ``phy2log`` (every rank should agree)."""
        return self.group.call(rank_placements)

    def shutdown(self) -> None:
        self.group.shutdown()


def _check_expert_split(path: Path, config: ParallelConfig) -> None:
    """Refuse before spawning when the expert slots cannot split evenly over the EP ranks (the ranks check it
    again when they shard; this only saves a start-up)."""
    if config.expert_parallel_size == 1:
        return
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # the ranks' loader reports a broken checkpoint with its own error
    experts = raw.get("text_config", raw).get("n_routed_experts")
    if isinstance(experts, int):
        expert_placement(experts, config.expert_parallel_size, config.num_redundant_experts)  # raises ValueError


def start_parallel(llm, path: Path, llm_kwargs: dict, config: ParallelConfig) -> None:
    """Spawn the ranks and give ``llm`` (a ``deepinfer_runtime.LLM`` being constructed) the attributes that
    ``generate`` / ``chat`` use, with a ``ParallelEngine`` as its engine. The driver loads no weights."""
    from deepinfer_runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)  # before spawning: a bad path fails here, without starting processes
    _check_expert_split(path, config)
    group = WorkerGroup(
        config.world_size,
        backend=config.backend,
        call_timeout_s=config.step_timeout_s,
        collective_timeout_s=config.step_timeout_s,
    )
    try:
        infos = group.call(init_rank, dict(llm_kwargs, model=str(path)), config)
    except BaseException:
        group.shutdown()
        raise
    atexit.register(group.shutdown)  # a script that never calls LLM.shutdown still stops its ranks in order
    info: RankInfo = infos[0]
    llm.model_path, llm.tokenizer, llm.model = path, tokenizer, info.model
    llm.max_model_len, llm.budget, llm.eos = info.max_model_len, info.budget, info.eos
    llm.prefix_cache = None  # per rank
    llm.engine = ParallelEngine(group, config, infos)
    if llm_kwargs.get("log_stats", True):
        print(
            f"[deepinfer] {config.world_size} ranks ({config.backend}): attention DP {config.data_parallel_size}, "
            f"EP {config.expert_parallel_size} ({info.num_ep_layers} layers, "
            f"{config.num_redundant_experts} redundant slots, EPLB {'on' if config.eplb else 'off'}), "
            f"CP {config.context_parallel_size}",
            file=sys.stderr,
        )

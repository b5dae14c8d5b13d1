"""The scheduler: one rule, a token budget, first come first served, preemption by recompute.

Rule (vLLM V1's): every step, each request's ``num_computed_tokens`` catches up towards its
``num_tokens`` by as many tokens as the step's budget allows. There is no prefill/decode split: a
long prompt is simply scheduled in chunks, a decode is a 1-token chunk, and both mix in one step.

Order: running requests first (oldest first), then waiting ones while seats, budget and KV blocks
last. When a running request's next chunk needs blocks and none are free, the most recently admitted
running request is preempted: its blocks and model state are dropped and it goes back to the front
of the queue, to be recomputed from scratch (its generated tokens are kept and re-fed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer_runtime.engine.kv_cache import BlockAllocator
from deepinfer_runtime.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # cap one request's chunk (0 = the whole budget)


@dataclass
class ScheduledChunk:
    """Run tokens [start, start + num_tokens) of ``request``; ``sample`` when the chunk reaches the end."""

    request: Request
    start: int
    num_tokens: int

    @property
    def sample(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class StepPlan:
    """What to run this step, in order; ``preempted`` lists requests sent back to the queue."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockAllocator):
        self.config, self.blocks = config, blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_len(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self.blocks.release(req.block_ids)
        req.cache, req.num_computed_tokens, req.status = None, 0, RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = self._chunk_len(req, budget)
            if n <= 0:
                continue
            while not self.blocks.can_grow(req.block_ids, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
            plan.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            n = self._chunk_len(req, budget)
            if not self.blocks.can_grow(req.block_ids, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.prefill_len = req.num_tokens  # YOCO's L for this (re)computation
            self.running.append(req)
            self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
            plan.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return plan

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.block_ids)
        req.cache = None

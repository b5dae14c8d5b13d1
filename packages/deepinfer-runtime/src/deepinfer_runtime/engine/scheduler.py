"""The scheduler: one rule, a token budget, first come first served, preemption by recompute.

Rule (vLLM V1's): every step, each request's ``num_computed_tokens`` catches up towards its
``num_tokens`` by as many tokens as the step's budget allows. There is no prefill/decode split: a
long prompt is simply scheduled in chunks, a decode is a 1-token chunk, and both mix in one step.

Order: running requests first (oldest first), then waiting ones while seats, budget and KV blocks
last. When a running request's next chunk needs blocks and none are free, the most recently admitted
running request is preempted: its blocks and model state are dropped and it goes back to the front
of the queue, to be recomputed from scratch (its generated tokens are kept and re-fed).

With a prefix cache, a request being admitted first looks up its known tokens: a hit sets its computed
tokens to the hit length and its block table to the shared blocks (``prefix_cache.py``), and non-final
chunks end on block boundaries so that their end states can be snapshotted for later hits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer_runtime.engine.kv_cache import BlockAllocator
from deepinfer_runtime.engine.prefix_cache import PrefixCache, chain_hashes
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

    @property
    def sample_at(self) -> int:
        """Position of the token this chunk samples (the request's length, pending tokens included)."""
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    """What to run this step, in order; ``preempted`` lists requests sent back to the queue."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockAllocator, prefix: PrefixCache | None = None):
        self.config, self.blocks, self.prefix = config, blocks, prefix
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
        n = min(n, cap) if cap > 0 else n
        start = req.num_computed_tokens
        if req.spec_token_ids:  # [anchor, drafts] run whole: drafts that do not fit the budget are dropped
            drop = req.num_tokens - start - n
            if drop:
                keep = max(len(req.spec_token_ids) - drop, 0)
                req.spec_token_ids = req.spec_token_ids[:keep]
                req.spec_logprobs = None if not keep else req.spec_logprobs[:keep]
            return req.num_tokens - start
        if self.prefix is not None and start + n < req.num_tokens:
            end = (start + n) // self.blocks.block_size * self.blocks.block_size
            n = end - start if end > start else n  # end on a block boundary: a snapshot point
        return n

    def _lookup_prefix(self, req: Request) -> None:
        """Start a fresh (or preempted) request from its longest usable cached prefix."""
        tokens = req.token_ids(0, req.num_known_tokens)
        req.block_keys = chain_hashes(tokens, self.blocks.block_size, req.block_keys)
        hit = self.prefix.lookup(tokens, req.block_keys)
        if hit is None:
            return
        req.block_ids.extend(hit.blocks)
        req.num_computed_tokens = hit.num_tokens
        if req.num_preemptions == 0:  # the metric counts the first admission, not a recompute's self-hit
            req.num_cached_tokens = hit.num_tokens
        req.num_registered_blocks, req.restore = len(hit.blocks), hit.snapshot

    def _drop_progress(self, req: Request) -> None:
        """Back to nothing computed: blocks released (cached ones stay hittable), prefix hit forgotten."""
        self.blocks.release(req.block_ids)
        req.num_computed_tokens, req.num_registered_blocks, req.restore = 0, 0, None
        req.clear_drafts()

    def _unadmit(self, req: Request) -> None:
        self._drop_progress(req)
        if req.num_preemptions == 0:
            req.num_cached_tokens = 0

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.running.remove(req)
        self._drop_progress(req)
        req.drop_cache()
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

    def slots_held(self) -> int:
        """Request slots held: running requests' and those of waiting requests that already have a cache."""
        return len(self.running) + sum(r.cache is not None for r in self.waiting)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk_len(req, budget)
            at_cap = req.reached_output_cap or req.num_tokens >= self.config.max_model_len
            if n <= 0 or (at_cap and req.num_pending):
                continue  # nothing to run, or only a token past the cap (it stops when its value arrives)
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
            if req.cache is None and self.slots_held() >= self.config.max_num_seqs:
                break  # every request slot is held (a CP-prefilled request waits with its cache)
            # prompt logprobs need the logits of every prompt row, so such a request never starts from a hit
            fresh = req.num_computed_tokens == 0 and not req.block_ids and req.params.prompt_logprobs is None
            if self.prefix is not None and fresh:
                self._lookup_prefix(req)
            n = self._chunk_len(req, budget)
            if not self.blocks.can_grow(req.block_ids, req.num_computed_tokens + n):
                self._unadmit(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.prefill_len = req.num_tokens  # YOCO's L for this (re)computation
            self.running.append(req)
            self.blocks.grow(req.block_ids, req.num_computed_tokens + n)
            plan.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return plan

    def computed(self, req: Request, num_tokens: int, snapshot) -> None:
        """Record that ``num_tokens`` more tokens of ``req`` ran; register its newly full blocks with the
        prefix cache and, on a block boundary during prefill, the state snapshot ``snapshot()`` makes."""
        start = req.num_computed_tokens
        req.num_computed_tokens += num_tokens
        if self.prefix is None:
            return
        bs = self.blocks.block_size
        full = min(req.num_computed_tokens, req.num_known_tokens) // bs  # keys need token values
        if full <= req.num_registered_blocks:
            return
        if len(req.block_keys) < full:
            req.block_keys = chain_hashes(req.token_ids(0, full * bs), bs, req.block_keys)
        req.num_registered_blocks = self.prefix.register(
            req.block_keys[:full], req.block_ids, req.num_registered_blocks
        )
        # the snapshot is the state after exactly these tokens: only when they all have known values
        if full * bs == req.num_computed_tokens and start < req.prefill_len:
            key = req.block_keys[full - 1]
            self.prefix.add_snapshot(key, snapshot)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        self.blocks.release(req.block_ids)
        req.drop_cache()

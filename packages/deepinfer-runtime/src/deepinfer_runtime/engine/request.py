"""Per-request state: the token sequence, how much of it the model has computed, and its outputs.

The scheduler's one rule is stated on this record: ``num_computed_tokens`` catches up to
``num_tokens`` (prompt + generated). A prefill chunk, a decode step and a recompute after preemption
are the same thing: the next ``min(num_tokens - num_computed_tokens, budget)`` tokens.

Under async scheduling a sampled token may still be on the device when the next step is planned: it
counts in ``num_tokens`` as ``num_pending`` (its value, -1 in ``token_ids``, is filled in on the device
by the runner), and only the ``num_known_tokens`` ever feed hashes, detokenizing or stop checks.

Under speculative decoding the drafts proposed for the next step (``spec_token_ids``) are tokens too: they
count in ``num_tokens`` and follow the known tokens in ``token_ids``, so the scheduler's one rule schedules
[anchor, drafts] as one chunk. Verification turns them into output tokens or rolls them back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer_runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a request is itself: the scheduler's lists find it by identity, not by comparing fields
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the effective per-request seed (params.seed, or derived from the engine seed)
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cache: Any = None  # the model's per-request state (None until first scheduled or after preemption)
    block_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    output_text: str = ""
    detokenizer: Any = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_len: int = 0  # tokens known when the current prefill started (YOCO's L)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks of known tokens
    num_registered_blocks: int = 0  # leading blocks of block_ids the prefix cache holds
    restore: Any = None  # CacheSnapshot of a prefix hit, consumed when the runner builds the cache
    prompt_logprobs: list | None = None  # [L]: None for token 0, then one entry per prompt token (if asked)
    grammar: Any = None  # structured.RequestGrammar when the request asks for structured outputs
    error: str | None = None  # why the engine ended this request with finish_reason "error"
    num_pending: int = 0  # sampled on the device, not yet appended (async: 1 when planned, 2 in between)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify at the next step
    spec_logprobs: Any = None  # fp32 [len(spec_token_ids), V]: the processed distributions they were drawn from
    spec_placeholder: bool = False  # the drafts are decision D6's placeholders (not counted in statistics)
    spec_num_proposed: int = 0  # drafts the proposer offered for the next step (varlen may verify fewer)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending + len(self.spec_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output (+ drafts); -1 for pending positions (values still on the
        device; speculative decoding runs synchronously, so a request never has both)."""
        p, known = len(self.prompt_token_ids), self.num_known_tokens
        if self.spec_token_ids and end > known:
            spec = self.spec_token_ids[max(start - known, 0) : end - known]
            return (self.token_ids(start, known) if start < known else []) + spec
        pad = [-1] * max(end - max(start, known), 0)
        end = min(end, known)
        if end <= p:
            return self.prompt_token_ids[start:end] + pad
        out = self.output_token_ids
        if start >= p:
            return out[start - p : end - p] + pad
        return self.prompt_token_ids[start:] + out[: end - p] + pad

    @property
    def reached_output_cap(self) -> bool:
        """Every token this request may produce has been sampled (some may still be pending)."""
        n = len(self.output_token_ids) + self.num_pending
        return self.params.max_tokens is not None and n >= self.params.max_tokens

    @property
    def sampler_needs_history(self) -> bool:
        """The next sample depends on the previous token's value (penalties, min_tokens, grammar), so the
        engine must not plan it before that token is known."""
        p = self.params
        penalties = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        return penalties or p.min_tokens > len(self.output_token_ids) or self.grammar is not None

    def drop_cache(self) -> None:
        """Give the model cache's slot back and forget it (finished, or preempted: recomputed later)."""
        if self.cache is not None:
            self.cache.release()
            self.cache = None

    def clear_drafts(self) -> None:
        self.spec_token_ids, self.spec_logprobs, self.spec_placeholder, self.spec_num_proposed = [], None, False, 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

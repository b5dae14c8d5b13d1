"""Per-request state: the token sequence, how much of it the model has computed, and its outputs.

The scheduler's one rule is stated on this record: ``num_computed_tokens`` catches up to
``num_tokens`` (prompt + generated). A prefill chunk, a decode step and a recompute after preemption
are the same thing: the next ``min(num_tokens - num_computed_tokens, budget)`` tokens.
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


@dataclass
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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        out = self.output_token_ids
        if start >= p:
            return out[start - p : end - p]
        return self.prompt_token_ids[start:] + out[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

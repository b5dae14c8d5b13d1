"""What ``LLM.generate`` returns, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_runtime.sampler import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" (EOS / stop string / stop token), "length", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    time_to_first_token: float | None
    decode_tokens_per_s: float | None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    spec_decoding: dict | None = None  # speculative decoding counters (``deepinfer_spec.AcceptanceCounts``)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when this request was rejected (bad prompt); the others still ran
    prompt_logprobs: list | None = field(default=None)

"""What the driver and the ranks send each other (pickled over the launcher's pipes), one dataclass per message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer_runtime.engine.request import Request
from deepinfer_runtime.loader.shard import LoadStats

# the fields a rank's copy of a request changes while it runs, copied back onto the driver's Request
_RESULT_FIELDS = (
    "output_token_ids",
    "output_text",
    "status",
    "finish_reason",
    "stop_reason",
    "logprobs",
    "cumulative_logprob",
    "prompt_logprobs",
    "num_computed_tokens",
    "num_cached_tokens",
    "num_preemptions",
    "first_token_time",
    "finish_time",
    "error",
)


@dataclass
class ModelView:
    """The driver's view of the model: configuration only, no weights (those live in the ranks).

    Attributes:
        cfg: the model config (``DeepseekV4Config`` / ``DeepseekV41Config``).
        yoco_mode: V4.1 YOCO truncation mode ("off" for V4).
        dtype: the ranks' model dtype.
    """

    cfg: Any
    yoco_mode: str
    dtype: torch.dtype


@dataclass
class RankInfo:
    """A rank's answer to start-up: what the driver needs to admit requests like a single-process LLM (rank 0's
    answer is used; every rank has the same), and what this rank's loader read."""

    model: ModelView
    budget: Any  # engine.kv_cache.CacheBudget of one rank (every rank has the same)
    max_model_len: int
    eos: set[int]
    num_ep_layers: int
    load: LoadStats


@dataclass
class RequestUpdate:
    """A finished request's results, from the rank that ran it."""

    request_id: str
    values: dict[str, Any]

    @classmethod
    def of(cls, req: Request) -> RequestUpdate:
        return cls(req.request_id, {name: getattr(req, name) for name in _RESULT_FIELDS})

    def apply(self, req: Request) -> None:
        for name, value in self.values.items():
            setattr(req, name, value)


@dataclass
class CPJob:
    """Prefill ``request``'s prompt (all but its last token) over the CP group of rank ``owner``; the owner then
    serves the request (its KV cache ends up in the owner's pools)."""

    owner: int
    request: Request


@dataclass
class StepReport:
    """One rank's answer to one engine step.

    Attributes:
        finished: requests that finished on this rank during the step.
        ran_forward: whether the rank ran a model forward (False: an empty step, EP joined with zero tokens).
        cp_prefilled: request ids this rank prefilled with CP as the owner.
        cp_fallbacks: CP jobs this rank owned but queued for ordinary prefill (no free KV blocks then).
        eplb_rearrangements / eplb_moved_slots: EPLB totals so far (0 when EPLB is off).
    """

    finished: list[RequestUpdate] = field(default_factory=list)
    ran_forward: bool = False
    cp_prefilled: list[str] = field(default_factory=list)
    cp_fallbacks: int = 0
    eplb_rearrangements: int = 0
    eplb_moved_slots: int = 0

"""Acceptance statistics, per request and over the whole run.

Definitions (one "verify step" = one target step of one request that verified its drafts):

* proposed: drafts the proposer produced (steps that carried the placeholder drafts of decision D6
  are not counted at all);
* verified: drafts that went through verification (num_verified; all proposed with varlen off);
* accepted: drafts accepted;
* emitted: tokens emitted by verify steps = accepted + 1 per step (the residual or bonus token);
* mean accepted length = emitted / verify steps = 1 + accepted / steps, vLLM's "mean acceptance
  length" (it counts the bonus token);
* draft acceptance rate = accepted / verified;
* per-position acceptance rate [i] = accepted at position i / verified at position i (position i =
  the (i+1)-th draft of a block); with varlen off every step verifies every position, and it equals
  vLLM's per-position rate (accepted at i / steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AcceptanceCounts:
    """Counters of one request or of the run (see the module docstring for the definitions)."""

    steps: int = 0
    proposed: int = 0
    verified: int = 0
    accepted: int = 0
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, verified: int, accepted: int) -> None:
        if not 0 <= accepted <= verified:
            raise ValueError(f"accepted ({accepted}) must lie in [0, verified = {verified}]")
        self.steps += 1
        self.proposed += proposed
        self.verified += verified
        self.accepted += accepted
        grow = verified - len(self.verified_per_position)
        if grow > 0:
            self.verified_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(verified):
            self.verified_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def emitted(self) -> int:
        return self.accepted + self.steps

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def position_acceptance_rates(self) -> list[float]:
        return [a / v if v else 0.0 for a, v in zip(self.accepted_per_position, self.verified_per_position)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec_verify_steps": self.steps,
            "spec_draft_tokens_proposed": self.proposed,
            "spec_draft_tokens_verified": self.verified,
            "spec_draft_tokens_accepted": self.accepted,
            "spec_tokens_emitted": self.emitted,
            "spec_mean_accepted_length": self.mean_accepted_length,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_position_acceptance_rates": self.position_acceptance_rates,
            "spec_position_verified": list(self.verified_per_position),
            "spec_position_accepted": list(self.accepted_per_position),
        }


@dataclass
class SpecStats:
    """Acceptance statistics per request id and in total; ``as_dict()`` is JSON-ready."""

    total: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    requests: dict[Any, AcceptanceCounts] = field(default_factory=dict)

    def record(self, request_id: Any, proposed: int, verified: int, accepted: int, placeholder: bool = False) -> None:
        """Record one verify step of one request. A step whose drafts were D6 placeholders
        (``placeholder=True``) is not counted: the statistics measure the proposer."""
        if placeholder:
            return
        if verified > proposed:
            raise ValueError(f"verified ({verified}) exceeds proposed ({proposed}) for request {request_id!r}")
        self.requests.setdefault(request_id, AcceptanceCounts()).add(proposed, verified, accepted)
        self.total.add(proposed, verified, accepted)

    def record_batch(
        self,
        request_ids: list[Any],
        num_proposed: torch.Tensor | list[int],
        num_verified: torch.Tensor | list[int],
        num_accepted: torch.Tensor | list[int],
        placeholder: torch.Tensor | list[bool] | None = None,
    ) -> None:
        """Record one step of a batch (e.g. from ``VerifyResult.num_verified`` / ``num_accepted``)."""
        proposed = _as_list(num_proposed)
        verified = _as_list(num_verified)
        accepted = _as_list(num_accepted)
        flags = [False] * len(request_ids) if placeholder is None else [bool(x) for x in _as_list(placeholder)]
        if not len(request_ids) == len(proposed) == len(verified) == len(accepted) == len(flags):
            raise ValueError("record_batch: every argument must have one entry per request")
        for rid, p, v, a, f in zip(request_ids, proposed, verified, accepted, flags):
            self.record(rid, int(p), int(v), int(a), f)

    def request_metrics(self, request_id: Any) -> dict[str, Any]:
        """The request's counters for ``RequestOutput.metrics`` (empty counters if never recorded)."""
        return self.requests.get(request_id, AcceptanceCounts()).as_dict()

    def pop_request(self, request_id: Any) -> dict[str, Any]:
        """``request_metrics`` and forget the request (its steps stay in the total)."""
        out = self.request_metrics(request_id)
        self.requests.pop(request_id, None)
        return out

    def as_dict(self) -> dict[str, Any]:
        """The run's totals (for the engine summary and the ``deepinfer bench`` JSON)."""
        return self.total.as_dict()


def _as_list(x: torch.Tensor | list) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)

"""Attention data parallelism: which DP rank gets a new request. Each rank runs attention for its own requests (its
own KV caches); balancing is by *tokens in flight* (tokens a rank still has to process or hold for its requests),
not request counts, because a 100K-token prompt costs as much as thousands of decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def assign_requests(request_tokens: Sequence[int], inflight: Sequence[int]) -> list[int]:
    """Assign requests, in arrival order, each to the DP rank with the fewest tokens in flight at that moment
    (ties to the lowest rank), counting the requests assigned before it.

    Args:
        request_tokens: per new request, its token weight (the engine uses prompt length + max new tokens).
        inflight: per DP rank, tokens already in flight.

    Returns:
        The rank of each request. Pure function; deterministic.
    """
    if not inflight:
        raise ValueError("assign_requests: need at least one DP rank")
    load = list(inflight)
    out = []
    for tokens in request_tokens:
        if tokens < 0:
            raise ValueError(f"assign_requests: negative token count {tokens}")
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        out.append(rank)
        load[rank] += tokens
    return out


@dataclass
class DPBalancer:
    """Tracks tokens in flight per DP rank as requests come and go (the scheduler's view)."""

    num_ranks: int
    inflight: list[int] = field(default_factory=list)
    _where: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError("DPBalancer: num_ranks must be >= 1")
        if not self.inflight:
            self.inflight = [0] * self.num_ranks

    def add(self, request_id: str, tokens: int, allowed: Sequence[int] | None = None) -> int:
        """Place a request on the least-loaded rank (of ``allowed`` ranks, default all); returns its rank."""
        if request_id in self._where:
            raise ValueError(f"DPBalancer: request {request_id!r} is already placed")
        if allowed is None:
            rank = assign_requests([tokens], self.inflight)[0]
        else:
            allowed = sorted(allowed)
            if not allowed or not all(0 <= r < self.num_ranks for r in allowed):
                raise ValueError(f"DPBalancer: allowed ranks {allowed} not a non-empty subset of [0, {self.num_ranks})")
            rank = allowed[assign_requests([tokens], [self.inflight[r] for r in allowed])[0]]
        self.inflight[rank] += tokens
        self._where[request_id] = (rank, tokens)
        return rank

    def finish(self, request_id: str) -> None:
        """Remove a finished (or aborted) request's tokens from its rank."""
        rank, tokens = self._where.pop(request_id)
        self.inflight[rank] -= tokens

    def rank_of(self, request_id: str) -> int:
        return self._where[request_id][0]

"""Procedure S (decisions section 3, D5): confidence-scheduled verification length.

Per step, with R requests:

* ``survivals``: a_{r,j} = prod_{i<=j} c_{r,i}, the running product of a block's confidences.
* ``choose_budget``: the total verify rows B* of the step, from the survivals of the *previous*
  block (those verified last step; one block older under asynchronous scheduling) and the cost model.
* ``admit``: each request's number of verified drafts, the top B* - R entries of the *current*
  survivals; since survivals never increase along j, each request gets a prefix of its drafts.
* ``VerifyCostModel`` / ``CostEstimator``: baseline_ms per profiled decode graph size, the runtime
  slope and sampler_ms estimators of step 3.

Lossless because whether d_j is verified depends only on c_{<=j} (known before d_j is sampled) and on
B*, which comes from older blocks. It makes a request's verify length depend on the batch, so it is
off in deterministic mode (decision B2).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch


def survivals(confidences: torch.Tensor | None, num_drafts: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i} (S.1), 0 past a request's drafts.

    Args:
        confidences: fp32 [R, N] c_{r,j} in [0, 1], or None for a proposer without confidences.
        num_drafts: int64 [R] drafts each request has (0 .. N).

    Returns:
        fp32 [R, N]. Without confidences a request counts 1.0 per draft it has (S.2); a request with
        no drafts counts 0.0.
    """
    r = num_drafts.shape[0]
    n = confidences.shape[1] if confidences is not None else int(num_drafts.max()) if r else 0
    has = torch.arange(n, device=num_drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    if confidences is None:
        return has.to(torch.float32)
    if confidences.shape != (r, n):
        raise ValueError(f"survivals: confidences must be [R, N] with R = {r}, got {tuple(confidences.shape)}")
    return torch.where(has, torch.cumprod(confidences.float(), 1), torch.zeros((), dtype=torch.float32))


@dataclass(frozen=True)
class VerifyCostModel:
    """The step cost of S.2: cost(B) = baseline_ms(g) + max(0, slope) g + sampler_ms, g = the smallest
    profiled decode graph size >= B.

    Attributes:
        graph_sizes: profiled decode graph sizes (rows), ascending.
        baseline_ms: the profiled step time of each graph size.
        slope_ms: the runtime-fitted per-row term (ms per row); negative values count as 0.
        sampler_ms: the sampler time for this request count.
    """

    graph_sizes: tuple[int, ...]
    baseline_ms: tuple[float, ...]
    slope_ms: float = 0.0
    sampler_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.graph_sizes or len(self.graph_sizes) != len(self.baseline_ms):
            raise ValueError("VerifyCostModel: graph_sizes and baseline_ms must be non-empty and of equal length")
        if list(self.graph_sizes) != sorted(set(self.graph_sizes)) or self.graph_sizes[0] < 1:
            raise ValueError(f"VerifyCostModel: graph_sizes must be ascending positive ints, got {self.graph_sizes}")

    @property
    def max_rows(self) -> int:
        return self.graph_sizes[-1]

    def graph_size(self, rows: int) -> int | None:
        """The smallest profiled size >= rows, or None beyond the largest."""
        i = bisect.bisect_left(self.graph_sizes, rows)
        return self.graph_sizes[i] if i < len(self.graph_sizes) else None

    def cost(self, rows: int) -> float:
        g = self.graph_size(rows)
        if g is None:
            raise ValueError(f"VerifyCostModel: {rows} rows exceed the largest profiled graph {self.max_rows}")
        return self.baseline_ms[self.graph_sizes.index(g)] + max(0.0, self.slope_ms) * g + self.sampler_ms


def choose_budget(
    prev_survivals: torch.Tensor, cost: VerifyCostModel, num_requests: int, max_rows: int | None = None
) -> int:
    """B*, the total verify rows of the step (S.2).

    Start at B = R (one anchor row per request), E = R; walk the previous block's survivals in
    descending order (ties: lower request, then lower j), each step B += 1, E += a; keep the B with
    the largest E / cost(B) (strictly greater replaces); stop beyond the largest profiled size (or
    ``max_rows``, the config's ``verify_budget``).

    Args:
        prev_survivals: fp32 [R', N] survivals of the drafts verified last step (``survivals``);
            R' may differ from R (finished and fresh requests); zeros count nothing.
        cost: the cost model for this request count.
        num_requests: R, requests in this step.
        max_rows: optional extra cap on B.

    Returns:
        B* >= R.
    """
    limit = cost.max_rows if max_rows is None else min(max_rows, cost.max_rows)
    if num_requests >= limit:
        return num_requests
    flat = prev_survivals.reshape(-1).double()
    order = torch.sort(flat, descending=True, stable=True).values.tolist()
    rows, expected = num_requests, float(num_requests)
    best_rows, best = rows, expected / cost.cost(rows)
    for a in order:
        rows += 1
        expected += a
        if rows > limit:
            break
        score = expected / cost.cost(rows)
        if score > best:
            best_rows, best = rows, score
    return best_rows


def admit(current_survivals: torch.Tensor, budget: int) -> torch.Tensor:
    """Drafts verified per request (S.4): the top ``budget - R`` entries of the current survivals.

    Ranked in stable descending order, ties to the lower flat index (request-major), so with
    survivals non-increasing along j each request's admitted set is a prefix of its drafts.

    Args:
        current_survivals: fp32 [R, N] survivals of the drafts about to be verified (0 past a
            request's drafts and for fresh requests).
        budget: B* from ``choose_budget`` (>= R).

    Returns:
        int64 [R] num_verified; each request's verify rows (seqlen) are 1 + num_verified.
    """
    r, n = current_survivals.shape
    if budget < r:
        raise ValueError(f"admit: budget {budget} is below the request count {r}")
    k = min(budget - r, r * n)
    order = torch.sort(current_survivals.reshape(-1), descending=True, stable=True).indices[:k]
    counts = torch.bincount(order // max(n, 1), minlength=r) if k else torch.zeros(r, dtype=torch.int64)
    return counts.to(torch.int64)


@dataclass
class CostEstimator:
    """The runtime estimators of S.3, fed by the engine after each step.

    * slope: over graph sizes with >= 10 samples, the median of the per-size median of
      (forward_ms - baseline_ms(g)) / g, over the last 5,000 steps;
    * sampler_ms: the median of the last 9 samples for this request count if it has >= 5, else the
      median of all recent samples, else 0.
    """

    graph_sizes: tuple[int, ...]
    baseline_ms: tuple[float, ...]
    history: int = 5000
    _forward: deque = field(default_factory=deque, repr=False)
    _sampler: dict[int, deque] = field(default_factory=dict, repr=False)
    _sampler_all: deque = field(default_factory=lambda: deque(maxlen=5000), repr=False)

    def record_forward(self, graph_size: int, forward_ms: float) -> None:
        self._forward.append((graph_size, forward_ms))
        while len(self._forward) > self.history:
            self._forward.popleft()

    def record_sampler(self, num_requests: int, sampler_ms: float) -> None:
        self._sampler.setdefault(num_requests, deque(maxlen=9)).append(sampler_ms)
        self._sampler_all.append(sampler_ms)

    def slope_ms(self) -> float:
        per_size: dict[int, list[float]] = {}
        base = dict(zip(self.graph_sizes, self.baseline_ms))
        for g, ms in self._forward:
            if g in base:
                per_size.setdefault(g, []).append((ms - base[g]) / g)
        medians = [statistics.median(v) for v in per_size.values() if len(v) >= 10]
        return statistics.median(medians) if medians else 0.0

    def sampler_ms(self, num_requests: int) -> float:
        mine = self._sampler.get(num_requests)
        if mine is not None and len(mine) >= 5:
            return statistics.median(mine)
        return statistics.median(self._sampler_all) if self._sampler_all else 0.0

    def model(self, num_requests: int) -> VerifyCostModel:
        return VerifyCostModel(
            tuple(self.graph_sizes), tuple(self.baseline_ms), self.slope_ms(), self.sampler_ms(num_requests)
        )


def schedule_verify(
    current_confidences: torch.Tensor | None,
    num_drafts: torch.Tensor,
    prev_survivals: torch.Tensor,
    cost: VerifyCostModel,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Procedure S end to end for one step: (num_verified int64 [R], B*).

    ``prev_survivals`` are the survivals of the block verified last step (``survivals`` of that
    block); ``current_confidences`` [R, N] (or None) come with the drafts about to be verified.
    """
    budget = choose_budget(prev_survivals, cost, num_drafts.shape[0], max_rows)
    current = survivals(current_confidences, num_drafts)
    return admit(current, budget), budget

"""Balanced context parallelism (CP) for long prefills: zigzag chunk assignment, work model and token exchange.

A prompt of S tokens is cut into 2W chunks (W = CP ranks); rank r takes chunks r and 2W-1-r. Under a causal
pattern a query at position p costs ~p+1, so pairing an early chunk with its mirror-image late chunk gives every
rank the same work (exactly, when 2W divides S). Contiguous splitting would give the last rank ~(2W-1)/W times the
mean.

What each rank needs from the others (the engine's CP prefill): every rank projects its own tokens, then
``cp_gather`` all-gathers the per-token tensors the attention needs into sequence order: the window KV (a rank's
first query in a chunk needs the W-1 tokens before it: ``window_halo``), the compressor inputs and the indexer
keys. With ``align`` = the largest compression ratio (128), chunk boundaries fall on compression-block boundaries,
so a rank can instead compress its own blocks and all-gather only the compressed entries (S / ratio rows). Each
rank then attends its own queries against the gathered keys and ``cp_gather`` reassembles the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import all_gather_rows


@dataclass(frozen=True)
class CPAssignment:
    """Which token positions each CP rank owns.

    Attributes:
        seq_len: S.
        ranges: per rank, its half-open position ranges [(start, stop), ...] in ascending order.
    """

    seq_len: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def positions(self, rank: int) -> torch.Tensor:
        """[n_r] int64 ascending positions owned by ``rank``."""
        parts = [torch.arange(a, b) for a, b in self.ranges[rank]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def num_tokens(self, rank: int) -> int:
        return sum(b - a for a, b in self.ranges[rank])


def _chunk_bounds(seq_len: int, num_chunks: int, align: int) -> list[tuple[int, int]]:
    """num_chunks contiguous chunks covering [0, seq_len), sizes multiples of ``align`` except the tail, as equal
    as possible (larger ones first)."""
    blocks = -(-seq_len // align)
    base, extra = divmod(blocks, num_chunks)
    bounds, start = [], 0
    for c in range(num_chunks):
        stop = min(seq_len, start + (base + (1 if c < extra else 0)) * align)
        bounds.append((start, stop))
        start = stop
    return bounds


def zigzag_assignment(seq_len: int, world_size: int, *, align: int = 1) -> CPAssignment:
    """Rank r gets chunks r and 2W-1-r of 2W chunks (chunk sizes multiples of ``align``; empty chunks possible
    when S < 2W * align)."""
    if world_size < 1 or align < 1 or seq_len < 0:
        raise ValueError(f"zigzag_assignment: bad seq_len={seq_len}, world_size={world_size}, align={align}")
    bounds = _chunk_bounds(seq_len, 2 * world_size, align)
    ranges = []
    for r in range(world_size):
        own = [bounds[r], bounds[2 * world_size - 1 - r]]
        ranges.append(tuple((a, b) for a, b in own if b > a))
    return CPAssignment(seq_len, tuple(ranges))


def balanced_assignment(
    seq_len: int,
    world_size: int,
    cost: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    align: int = 1,
) -> CPAssignment:
    """Zigzag pairing of 2W chunks whose boundaries are placed so that every chunk carries ~1/(2W) of the total
    ``cost`` (per-position cost, e.g. a per-token constant for the dense layers plus ``sparse_work``). Plain zigzag
    is exact for the causal pattern; this is for patterns whose work saturates (window + top-k capped compressed
    entries), where equal-length chunks leave the rank holding the first chunk lighter. Chunk boundaries are
    multiples of ``align``. ``cost`` None means ``causal_work``."""
    if world_size < 1 or align < 1 or seq_len < 0:
        raise ValueError(f"balanced_assignment: bad seq_len={seq_len}, world_size={world_size}, align={align}")
    cost = cost or causal_work
    num_chunks = 2 * world_size
    per_pos = cost(torch.arange(seq_len)).double()
    blocks = -(-seq_len // align)
    per_block = torch.zeros(blocks, dtype=torch.float64).index_add_(0, torch.arange(seq_len) // align, per_pos)
    cum = torch.cumsum(per_block, 0)
    total = float(cum[-1]) if blocks else 0.0
    targets = torch.tensor([total * c / num_chunks for c in range(1, num_chunks)], dtype=torch.float64)
    # boundary after the block where the cumulative cost first reaches the target (nearest of the two sides)
    ends = torch.searchsorted(cum, targets).clamp(max=max(blocks - 1, 0))
    before = torch.where(ends > 0, cum[(ends - 1).clamp(min=0)], torch.zeros_like(targets)) if blocks else targets
    nearer_left = (targets - before) < (cum[ends] - targets) if blocks else targets.bool()
    cut_blocks = torch.where(nearer_left, ends, ends + 1).tolist()
    cuts = [0] + [min(seq_len, b * align) for b in cut_blocks] + [seq_len]
    for i in range(1, len(cuts)):  # keep them ordered
        cuts[i] = max(cuts[i], cuts[i - 1])
    bounds = list(zip(cuts[:-1], cuts[1:]))
    ranges = []
    for r in range(world_size):
        own = [bounds[r], bounds[num_chunks - 1 - r]]
        ranges.append(tuple((a, b) for a, b in own if b > a))
    return CPAssignment(seq_len, tuple(ranges))


def contiguous_assignment(seq_len: int, world_size: int) -> CPAssignment:
    """The naive split (rank r gets the r-th of W contiguous chunks), for comparison."""
    bounds = _chunk_bounds(seq_len, world_size, 1)
    return CPAssignment(seq_len, tuple(((a, b),) if b > a else () for a, b in bounds))


def causal_work(positions: torch.Tensor) -> torch.Tensor:
    """[n] keys attended by a causal query at each position: p + 1 (float64)."""
    return positions.double() + 1


def sparse_work(positions: torch.Tensor, *, window: int, ratio: int, top_k: int | None = None) -> torch.Tensor:
    """[n] keys attended per query under the V4 sparse pattern (float64): a sliding window of ``window`` tokens
    plus the compressed entries visible at p: floor((p + 1) / ratio) complete blocks (a compressor emits one entry
    per ``ratio`` tokens once the block is complete), capped at ``top_k`` when an indexer selects (None: all)."""
    p = positions.double()
    window_part = torch.clamp(p + 1, max=window)
    compressed = torch.floor((p + 1) / ratio)
    if top_k is not None:
        compressed = torch.clamp(compressed, max=top_k)
    return window_part + compressed


def rank_work(assignment: CPAssignment, work: Callable[[torch.Tensor], torch.Tensor] = causal_work) -> torch.Tensor:
    """[W] float64 total attention work of each rank under ``work`` (per-query key counts)."""
    return torch.tensor([float(work(assignment.positions(r)).sum()) for r in range(assignment.world_size)])


def imbalance(per_rank: torch.Tensor) -> float:
    """max / mean (1.0 = perfectly balanced)."""
    mean = float(per_rank.double().mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0


def window_halo(assignment: CPAssignment, rank: int, window: int) -> list[tuple[int, int]]:
    """Position ranges ``rank`` needs from other ranks for its sliding windows: for each owned range [a, b), the
    up-to ``window - 1`` positions before a that it does not own."""
    own = assignment.ranges[rank]
    halo: list[tuple[int, int]] = []
    for a, _ in own:
        pieces = [(max(0, a - (window - 1)), a)]
        for x, y in own:  # subtract what the rank owns
            pieces = [q for lo, hi in pieces for q in ((lo, min(hi, x)), (max(lo, y), hi)) if q[1] > q[0]]
        halo.extend(p for p in pieces if p not in halo)
    return sorted(halo)


def cp_scatter(x: torch.Tensor, assignment: CPAssignment, rank: int) -> torch.Tensor:
    """[S, ...] sequence-ordered tensor -> [n_r, ...] this rank's positions (no communication)."""
    return x[assignment.positions(rank).to(x.device)]


def cp_gather(x_local: torch.Tensor, assignment: CPAssignment, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Inverse of ``cp_scatter`` over the group (collective): every rank gets the [S, ...] tensor in sequence order.

    Args:
        x_local: [n_r, ...] this rank's rows, in ``assignment.positions(rank)`` order (any dtype; bitwise exact).
    """
    parts = all_gather_rows(x_local, group)
    out = torch.empty((assignment.seq_len, *x_local.shape[1:]), dtype=x_local.dtype, device=x_local.device)
    for r, part in enumerate(parts):
        out[assignment.positions(r).to(x_local.device)] = part
    return out

"""Row-sharded tables (Engram n-gram tables, the vocabulary-sized embedding): each rank holds a contiguous block
of rows and any rank can gather arbitrary rows with one all-to-all. See ``placement.md`` for why.

``RowSharding(num_rows, world)`` splits rows into ``world`` contiguous blocks of ceil(num_rows / world) rows (the
last may be shorter). ``gather_rows`` is a collective: every rank passes its own row ids (any number, repeats
allowed) and gets those rows back, exactly (bytes on the wire: FP8 rows and their scales work as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._comm import _from_wire, _to_wire, all_to_all_rows, exchange_counts


@dataclass(frozen=True)
class RowSharding:
    """Contiguous row blocks: rank r owns rows [start(r), stop(r))."""

    num_rows: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_rows < 0 or self.world_size < 1:
            raise ValueError(f"RowSharding: bad num_rows={self.num_rows} / world_size={self.world_size}")

    @property
    def block(self) -> int:
        return -(-self.num_rows // self.world_size)

    def start(self, rank: int) -> int:
        return min(rank * self.block, self.num_rows)

    def stop(self, rank: int) -> int:
        return min((rank + 1) * self.block, self.num_rows)

    def owner(self, rows: torch.Tensor) -> torch.Tensor:
        """[N] int64 owning rank of each global row id."""
        return torch.div(rows, self.block, rounding_mode="floor") if self.block else torch.zeros_like(rows)


def shard_rows(table: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``table`` ([num_rows, ...]) as a view: rows [start, stop)."""
    sh = RowSharding(table.shape[0], world_size)
    return table[sh.start(rank) : sh.stop(rank)]


def gather_rows(
    local: torch.Tensor,
    rows: torch.Tensor,
    num_rows: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Gather global rows ``rows`` of a table sharded with ``RowSharding(num_rows, world)`` (collective).

    Args:
        local: [stop - start, ...] this rank's block (any dtype; same trailing shape and dtype on every rank).
        rows: [N] integer global row ids in [0, num_rows) wanted by this rank (N may differ per rank; may be 0).
        num_rows: total rows of the table.
        device: where the exchange happens (default ``local.device``); with NCCL and a host-memory shard, pass the
            rank's CUDA device: the owner gathers from host memory and the rows travel on the GPU.

    Returns:
        [N, ...] the rows, in the order of ``rows``, bitwise equal to ``table[rows]``; on ``device``.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sh = RowSharding(num_rows, world)
    expected = sh.stop(rank) - sh.start(rank)
    if local.shape[0] != expected:
        raise ValueError(f"gather_rows: rank {rank} holds {local.shape[0]} rows, expected {expected}")
    dev = torch.device(device) if device is not None else local.device
    rows = rows.reshape(-1).long().cpu()
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ValueError(f"gather_rows: row ids must be in [0, {num_rows})")
    owner = sh.owner(rows)
    order = torch.sort(owner, stable=True).indices
    send_counts = torch.bincount(owner, minlength=world).tolist()
    recv_counts = exchange_counts(send_counts, group, dev)
    asked = all_to_all_rows(rows[order].to(dev)[:, None], send_counts, recv_counts, group)[:, 0]
    answer = local[(asked - sh.start(rank)).to(local.device)].to(dev)
    got = all_to_all_rows(answer, recv_counts, send_counts, group)
    # unpermute as raw bytes: index_put has no kernel for some dtypes (float8_e8m0fnu scales)
    wire, _ = _to_wire(got)
    out = torch.empty_like(wire)
    out[order.to(dev)] = wire
    return _from_wire(out, got, got.shape[0])

"""Row-wise collectives for any dtype (payloads travel as raw bytes, so bf16 / FP8 / int work on gloo and NCCL)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _to_wire(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    row_bytes = x.shape[1:].numel() * x.element_size()
    return x.contiguous().reshape(-1).view(torch.uint8).reshape(x.shape[0], row_bytes), row_bytes


def _from_wire(wire: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    return wire.reshape(-1).view(like.dtype).reshape(rows, *like.shape[1:])


def all_to_all_rows(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``all_to_all_single`` along dim 0: rows ``send_splits[j]`` go to rank j; returns [sum(recv_splits), ...]
    (rank-major), same dtype and device as ``send``."""
    wire, row_bytes = _to_wire(send)
    out = torch.empty((sum(recv_splits), row_bytes), dtype=torch.uint8, device=send.device)
    dist.all_to_all_single(out, wire, recv_splits, send_splits, group=group)
    return _from_wire(out, send, sum(recv_splits))


def exchange_counts(counts: list[int], group: dist.ProcessGroup | None = None, device=None) -> list[int]:
    """Each rank sends ``counts[j]`` to rank j; returns what every rank sent to this one (rank order)."""
    world = dist.get_world_size(group)
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, send, [1] * world, [1] * world, group=group)
    return recv.cpu().tolist()


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``x`` ([n_r, ...], n_r may differ, same trailing shape and dtype) in rank order (padded
    ``all_gather`` underneath)."""
    world = dist.get_world_size(group)
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = [int(s) for s in sizes]
    wire, row_bytes = _to_wire(x)
    padded = torch.zeros((max(sizes_l), row_bytes), dtype=torch.uint8, device=x.device)
    padded[: x.shape[0]] = wire
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    return [_from_wire(b[:s], x, s) for b, s in zip(bufs, sizes_l)]

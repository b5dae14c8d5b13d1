"""Plain-PyTorch cache row ids and row writes (the definition of correct): a few elementwise int64 ops per call.

``ring_rows_ref`` is the body ``DecodeBatch.ring_ids`` had before the op existed, op for op; ``paged_rows_ref`` is
``DecodeBatch.pool_rows``'s gather through the block tables plus the offset and the out-of-table rule. Each row
reads only its own inputs: row-invariant by construction.
"""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("ring_rows")
def ring_rows_ref(
    pos: torch.Tensor, slots: torch.Tensor, first: torch.Tensor, capacity: int, n: int, every: int = 1
) -> torch.Tensor:
    key_pos = pos[:, None] + torch.arange(1 - n, 1, device=pos.device)  # [rows, n]: p - n + 1 .. p
    ids = slots[:, None] * capacity + key_pos.clamp(min=0) % capacity
    held = key_pos >= first[:, None]
    if every > 1:
        held = held & ((pos + 1) % every == 0)[:, None]
    return torch.where(held, ids, -1)


@register_reference("paged_rows")
def paged_rows_ref(
    ids: torch.Tensor | int,
    tables: torch.Tensor,
    rows_per_block: int,
    offset: int = 0,
    limit: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    if isinstance(ids, int):  # entries 0 .. ids - 1 of every request
        ids = torch.arange(ids, device=tables.device)[None].expand(tables.shape[0], -1)
    if limit is not None:  # entries at or past a request's limit are none
        ids = torch.where(ids < limit[:, None], ids, -1)
    safe = ids.clamp(min=0)
    block = safe // rows_per_block
    ok = (ids >= 0) & (block < tables.shape[1])
    if tables.shape[1] == 0:  # nothing to gather from: every entry is past the table
        out = torch.full_like(ids, -1)
    else:
        blocks = tables.gather(1, torch.where(ok, block, 0))
        out = torch.where(ok, blocks * rows_per_block + safe % rows_per_block + offset, -1)
    return out if prefix is None else torch.cat([prefix, out], dim=1)


@register_reference("gather_rows")
def gather_rows_ref(table: torch.Tensor, index: torch.Tensor, copies: int | None = None) -> torch.Tensor:
    return table[index] if copies is None else table[index[:, None].expand(-1, copies)]


@register_reference("scatter_rows")
def scatter_rows_ref(table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    table[index] = rows.to(table.dtype)


@register_reference("ring_scatter")
def ring_scatter_ref(
    buffer: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    bias: torch.Tensor | None = None,
    bias_index: torch.Tensor | None = None,
) -> None:
    if bias is not None:
        rows = rows + bias[bias_index]
    buffer[slots, pos % buffer.shape[1]] = rows.to(buffer.dtype)

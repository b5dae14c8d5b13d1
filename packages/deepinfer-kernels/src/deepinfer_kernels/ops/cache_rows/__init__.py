"""Cache row ids and row writes of a planned decode step: where each request's ring positions and paged entries
sit, the writes of its new rows there (``scatter_rows``, ``ring_scatter``), and the row gather that starts a step
(``gather_rows``: the token embeddings, each in every residual stream).

A decode step reads its caches in place (``deepinfer_runtime.decode_batch``): the sliding window and the
compressors' groups from ring buffers held as one flat row table of num_slots x capacity rows (request b's
position q at row ``slots[b] * capacity + q % capacity``), and the compressed entries attention selects from a
paged pool through each request's block table (entry e at row ``tables[b, e // R] * R + e % R``). Both ops turn a
request's positions / entry numbers into those row ids (-1: none) in one call, for the attention and pooling
kernels that take row ids (``sparse_mqa_attention``, ``kv_compress_pool_rows``). They read only device tensors
and sync nothing with the host, so a step using them can be captured in a CUDA graph. Results are integers: every
backend returns exactly the reference's values.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)

try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass


def _check_int(op: str, name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{op}: {name} must be an int >= {low}, got {value!r}")
    return value


def ring_rows(
    pos: torch.Tensor, slots: torch.Tensor, first: torch.Tensor, capacity: int, n: int, every: int = 1
) -> torch.Tensor:
    """Rows of a flat ring table holding each request's last ``n`` positions (-1 where not held).

    Request b is at position p = pos[b]; its ring is slot ``slots[b]`` of a table of num_slots x ``capacity``
    rows, holding the positions from ``first[b]`` on. Entry j (0 <= j < n) stands for position q = p - n + 1 + j
    (oldest first) and is

        out[b, j] = slots[b] * capacity + max(q, 0) % capacity   if q >= first[b] (and, with every > 1,
                                                                  (p + 1) % every == 0)
                  = -1                                            otherwise.

    With ``every`` only the requests whose p + 1 is a multiple of it get rows (a compressor's group of ``every``
    rows completes there), the others a row of -1. Nothing checks that the ring keeps n rows: with n > capacity
    entries alias (the caller, ``DecodeBatch.ring_ids``, refuses that).

    Args:
        pos: [rows] int64 positions.
        slots: [rows] int64 ring slots (the table's row blocks).
        first: [rows] int64, each request's oldest held position (any value; positions below it give -1).
        capacity: int >= 1, rows per slot (the ring's R).
        n: int >= 0, positions per request.
        every: int >= 1.

    Returns:
        [rows, n] int64 on pos's device. See reference.py.
    """
    op = "ring_rows"
    for name, t in (("pos", pos), ("slots", slots), ("first", first)):
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape != pos.shape:
            raise ValueError(
                f"{op}: pos, slots and first must be int64 [rows], got {name} {t.dtype}{tuple(t.shape)} "
                f"(pos {tuple(pos.shape)})"
            )
        if t.device != pos.device:
            raise ValueError(f"{op}: pos, slots and first must be on one device, got {name} on {t.device}")
    capacity = _check_int(op, "capacity", capacity, 1)
    n = _check_int(op, "n", n, 0)
    every = _check_int(op, "every", every, 1)
    return dispatch(op, pos.device, pos, slots, first, capacity, n, every)


def paged_rows(
    ids: torch.Tensor | int,
    tables: torch.Tensor,
    rows_per_block: int,
    offset: int = 0,
    *,
    limit: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of a paged pool (blocks of ``rows_per_block`` rows, flattened) holding each request's entries ``ids``.

    Request b's entry e lives in block ``tables[b, e // R]`` at row e % R (R = rows_per_block), so

        out[b, k] = tables[b, e // R] * R + e % R + offset   for e = ids[b, k] >= 0 with e // R < width
                  = -1                                       for e < 0 (no entry) or e // R >= width.

    An entry past the table (e // R >= width) has no row: -1, like no entry (callers never pass one; the op
    defines it rather than reading out of bounds). ``offset`` shifts every row (the pool as the second segment of
    a row table, after ``offset`` rows of another); -1 stays -1. Two options save a decode step the launches
    that would make their inputs or use the result:

    * ``limit``: entries e >= limit[b] are none (-1), e.g. the entries a request sees; with ``ids`` = K (an int)
      every request asks for its entries 0 .. K - 1, so ``paged_rows(K, tables, R, limit=visible)`` is
      ``paged_rows(where(arange(K) < visible[:, None], arange(K), -1), tables, R)``;
    * ``prefix``: [rows, P] int64 copied in front: the result is ``cat([prefix, rows], 1)`` (an attention row
      table's first segment, the window's rows, before the pool's).

    Args:
        ids: [rows, K] int64 entry numbers of each request, -1 (any negative) = none; or an int K >= 0 (entries
            0 .. K - 1 of every request).
        tables: [rows, width] int64 block tables (block ids >= 0).
        rows_per_block: int >= 1, R.
        offset: int >= 0 added to every row.
        limit: None or [rows] int64.
        prefix: None or [rows, P] int64.

    Returns:
        [rows, P + K] int64 on tables' device (P = 0 without a prefix). See reference.py.
    """
    op = "paged_rows"
    if tables.dim() != 2 or tables.dtype != torch.int64:
        raise ValueError(f"{op}: tables must be int64 [rows, width], got {tables.dtype}{tuple(tables.shape)}")
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise ValueError(f"{op}: ids must be int64 [rows, K] (or an int K), got {ids.dtype}{tuple(ids.shape)}")
        if ids.shape[0] != tables.shape[0]:
            raise ValueError(f"{op}: ids {tuple(ids.shape)} and tables {tuple(tables.shape)} must have the same rows")
        if ids.device != tables.device:
            raise ValueError(f"{op}: ids on {ids.device} and tables on {tables.device} must be on one device")
    else:
        ids = _check_int(op, "ids (an entry count)", ids, 0)
    rows = tables.shape[0]
    for name, t, dims in (("limit", limit, 1), ("prefix", prefix, 2)):
        if t is None:
            continue
        if t.dim() != dims or t.dtype != torch.int64 or t.shape[0] != rows or t.device != tables.device:
            want = f"[{rows}]" if dims == 1 else f"[{rows}, P]"
            raise ValueError(f"{op}: {name} must be int64 {want} on {tables.device}, got {t.dtype}{tuple(t.shape)}")
    rows_per_block = _check_int(op, "rows_per_block", rows_per_block, 1)
    offset = _check_int(op, "offset", offset, 0)
    return dispatch(op, tables.device, ids, tables, rows_per_block, offset, limit, prefix)


def _check_write(op: str, table: torch.Tensor, rows: torch.Tensor, index: dict[str, torch.Tensor], dims: int) -> None:
    if table.dim() != dims or rows.dim() != 2 or rows.shape[1] != table.shape[-1]:
        raise ValueError(
            f"{op}: table must be {dims}-D with rows [B, {table.shape[-1] if table.dim() else 'C'}] of its width, "
            f"got table {tuple(table.shape)} and rows {tuple(rows.shape)}"
        )
    if table.dim() and table.stride(-1) != 1 or (dims == 3 and not table.is_contiguous()):
        raise ValueError(f"{op}: the table must be contiguous along its rows (strides {table.stride()})")
    for name, t in index.items():
        if t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != rows.shape[0]:
            raise ValueError(f"{op}: {name} must be int64 [{rows.shape[0]}], got {t.dtype}{tuple(t.shape)}")
    for t in (rows, *index.values()):
        if t.device != table.device:
            raise ValueError(f"{op}: table on {table.device}, an input on {t.device}: one device")


def gather_rows(table: torch.Tensor, index: torch.Tensor, copies: int | None = None) -> torch.Tensor:
    """``table[index]``: rows of a table by id ([B, C]); with ``copies``, each row ``copies`` times ([B, copies, C],
    ``table[index[:, None].expand(-1, copies)]``: a token's embedding in each of the hc_mult residual streams).

    Args:
        table: [N, C] any dtype, unit stride along C (an embedding matrix).
        index: [B] int64 row ids, 0 <= index < N (the caller checks them: token ids are checked at admission; the
            GPU kernel does not re-check).
        copies: None, or an int >= 1.

    Returns:
        a new contiguous tensor of table's dtype, the same values (a copy: bitwise on every backend).
    """
    op = "gather_rows"
    if table.dim() != 2 or table.stride(-1) != 1:
        raise ValueError(f"{op}: table must be 2-D [N, C] with unit stride along C, got {tuple(table.shape)}")
    if index.dim() != 1 or index.dtype != torch.int64 or index.device != table.device:
        raise ValueError(
            f"{op}: index must be int64 [B] on {table.device}, got {index.dtype}{tuple(index.shape)} on {index.device}"
        )
    if copies is not None:
        _check_int(op, "copies", copies, 1)
    return dispatch(op, table.device, table, index, copies)


def scatter_rows(table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """``table[index[b]] = rows[b]`` cast to table's dtype, in place (a paged pool's new entries).

    Args:
        table: [N, C] any dtype, unit stride along C (a pool's flat rows).
        rows: [B, C] any float dtype (cast like ``Tensor.to``).
        index: [B] int64 rows of ``table`` (0 <= index < N); two equal ids leave either row there.
    """
    _check_write("scatter_rows", table, rows, {"index": index}, 2)
    dispatch("scatter_rows", table.device, table, rows, index)


def ring_scatter(
    buffer: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    bias_index: torch.Tensor | None = None,
) -> None:
    """``buffer[slots[b], pos[b] % R] = rows[b]`` cast to buffer's dtype, in place (a decode step's new ring rows).
    With ``bias`` the row written is ``rows[b] + bias[bias_index[b]]`` (torch's sum: one fp32 addition, since
    the two dtypes must promote to fp32), then cast: a compressor's score plus its position bias, one launch.

    Args:
        buffer: [S, R, C] contiguous ring buffers (S slots of R rows).
        rows: [B, C] any float dtype (cast like ``Tensor.to``).
        slots: [B] int64 slots (0 <= slot < S); two requests in one slot leave either row there.
        pos: [B] int64 positions >= 0.
        bias: None or [N, C] float, contiguous along C, with rows or bias fp32 (their sum is fp32);
        bias_index: [B] int64 rows of bias (0 <= bias_index < N), given exactly with bias.
    """
    op = "ring_scatter"
    index = {"slots": slots, "pos": pos}
    if (bias is None) != (bias_index is None):
        raise ValueError(f"{op}: bias and bias_index come together")
    if bias is not None:
        index["bias_index"] = bias_index
        if bias.dim() != 2 or bias.shape[1] != rows.shape[-1] or bias.stride(-1) != 1:
            raise ValueError(
                f"{op}: bias must be [N, {rows.shape[-1]}] with unit stride along C, got {tuple(bias.shape)}"
            )
        if torch.promote_types(rows.dtype, bias.dtype) != torch.float32 or bias.device != buffer.device:
            raise ValueError(
                f"{op}: rows {rows.dtype} + bias {bias.dtype} on {bias.device} must sum in fp32 on {buffer.device}"
            )
    _check_write(op, buffer, rows, index, 3)
    dispatch(op, buffer.device, buffer, rows, slots, pos, bias, bias_index)

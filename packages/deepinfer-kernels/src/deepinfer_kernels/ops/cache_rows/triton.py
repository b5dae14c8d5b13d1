"""Triton cache row ids, row writes and the row gather (CUDA backend ``triton`` of ``ring_rows``, ``paged_rows``,
``scatter_rows``, ``ring_scatter`` and ``gather_rows``): one launch each.

Grid (rows, column blocks of BLOCK): a program loads its request's scalars (position, slot, first held position;
or its block table row through the masked gather) and writes BLOCK row ids, int64 throughout, the tail masked.
They replace chains of 8-12 tiny torch kernels per call in a decode step. The formulas are the reference's:
``%`` and ``//`` only ever see non-negative operands (max(q, 0), max(e, 0)), where Triton's truncating
division and torch's flooring one agree, and ``(p + 1) % every == 0`` holds under either convention alike (with
every = 1 always: no branch), so the results equal the reference exactly. Each row reads only its own inputs:
batch-invariant. No host reads: capturable in CUDA graphs. ``paged_rows``'s options cost no launch of their own:
an entry count instead of ids (COUNT), a per-request limit, and a prefix copied into the first P columns (a program's
column block may hold prefix and entry columns alike), so a decode step's attention row table is one launch.

``_scatter_rows_kernel``: grid (rows, column blocks); a program computes its destination row (the given row id,
or slot * R + pos % R for a ring: pos >= 0, so truncating and flooring ``%`` agree) and copies BLOCK columns,
cast to the table's dtype as ``Tensor.to`` does (round to nearest even), in place of a remainder, an index_put and
a cast copy; with a bias (``ring_scatter``) it adds the bias row first, one fp32 addition as torch's.

``_gather_rows_kernel``: grid (rows, column blocks); a program loads its row id and copies BLOCK columns of that
table row to each of its COPIES output rows. torch's advanced indexing took 5 us for a batch-1 step's embedding and
22-27 us at batch 256 (a [256, 4, 4096] bf16 gather, element by element with 64-bit index arithmetic, and without
programmatic dependent launch: the first kernel of every decode step).
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

MAX_BLOCK = 1024


@triton.jit
def _ring_rows_kernel(
    pos_ptr, slots_ptr, first_ptr, out_ptr, N, CAP, EVERY, POS_STRIDE, SLOTS_STRIDE, FIRST_STRIDE,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    p = tl.load(pos_ptr + b * POS_STRIDE)
    slot = tl.load(slots_ptr + b * SLOTS_STRIDE)
    first = tl.load(first_ptr + b * FIRST_STRIDE)
    q = p - N + 1 + j  # positions p - n + 1 .. p
    row = slot * CAP + tl.maximum(q, 0) % CAP
    held = (q >= first) & ((p + 1) % EVERY == 0)
    tl.store(out_ptr + b * N + j, tl.where(held, row, -1), mask=j < N)


@triton.jit
def _paged_rows_kernel(
    ids_ptr, tables_ptr, limit_ptr, prefix_ptr, out_ptr, K, P, W, R, OFFSET, IDS_STRIDE_B, IDS_STRIDE_K,
    TAB_STRIDE_B, TAB_STRIDE_W, PRE_STRIDE_B, PRE_STRIDE_P,
    COUNT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Output column j of row b: prefix[b, j] for j < P, else the row of entry k = j - P (ids[b, k], or k itself
    with COUNT), -1 at or past limit[b] (HAS_LIMIT)."""
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_j = j < P + K
    k = j - P
    in_k = in_j & (k >= 0)
    if COUNT:
        e = tl.where(in_k, k, -1)
    else:
        e = tl.load(ids_ptr + b * IDS_STRIDE_B + k * IDS_STRIDE_K, mask=in_k, other=-1)
    if HAS_LIMIT:
        e = tl.where(e < tl.load(limit_ptr + b), e, -1)
    safe = tl.maximum(e, 0)
    block = safe // R
    ok = in_k & (e >= 0) & (block < W)
    t = tl.load(tables_ptr + b * TAB_STRIDE_B + block * TAB_STRIDE_W, mask=ok, other=0)
    row = tl.where(ok, t * R + safe % R + OFFSET, -1)
    if HAS_PREFIX:
        pre = j < P
        row = tl.where(pre, tl.load(prefix_ptr + b * PRE_STRIDE_B + j * PRE_STRIDE_P, mask=in_j & pre, other=0), row)
    tl.store(out_ptr + b * (P + K) + j, row, mask=in_j)


@triton.jit
def _scatter_rows_kernel(
    table_ptr, rows_ptr, index_ptr, pos_ptr, bias_ptr, bias_index_ptr, C, R, ROW_STRIDE, COL_STRIDE, TABLE_STRIDE,
    BIAS_STRIDE, RING: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    dst = tl.load(index_ptr + b)
    if RING:  # index holds the slots
        dst = dst * R + tl.load(pos_ptr + b) % R
    ok = c < C
    v = tl.load(rows_ptr + b * ROW_STRIDE + c * COL_STRIDE, mask=ok)
    if HAS_BIAS:  # the row plus its bias row: one fp32 addition, as torch sums two tensors promoting to fp32
        bias_row = tl.load(bias_index_ptr + b)
        v = v.to(tl.float32) + tl.load(bias_ptr + bias_row * BIAS_STRIDE + c, mask=ok).to(tl.float32)
    tl.store(table_ptr + dst * TABLE_STRIDE + c, v.to(table_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gather_rows_kernel(
    table_ptr, index_ptr, out_ptr, C, TABLE_STRIDE, COPIES: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = c < C
    v = tl.load(table_ptr + tl.load(index_ptr + b) * TABLE_STRIDE + c, mask=ok)
    for j in tl.static_range(COPIES):
        tl.store(out_ptr + (b * COPIES + j) * C + c, v, mask=ok)


def _block(cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for ``cols`` columns: one program covers up to MAX_BLOCK of a row."""
    block = min(MAX_BLOCK, max(16, triton.next_power_of_2(cols)))
    return block, max(1, min(4, block // 256))


def ring_rows_triton(
    pos: torch.Tensor, slots: torch.Tensor, first: torch.Tensor, capacity: int, n: int, every: int = 1
) -> torch.Tensor:
    """The op (contract in ``__init__.py``)."""
    require_same_device(pos, slots, first)
    out = torch.empty(pos.shape[0], n, dtype=torch.int64, device=pos.device)
    if out.numel():
        block, warps = _block(n)
        grid = (pos.shape[0], triton.cdiv(n, block))
        _ring_rows_kernel[grid](
            pos, slots, first, out, n, capacity, every, pos.stride(0), slots.stride(0), first.stride(0),
            BLOCK=block, num_warps=warps, **pdl_options(pos.device),
        )  # fmt: skip
    return out


def paged_rows_triton(
    ids: torch.Tensor | int,
    tables: torch.Tensor,
    rows_per_block: int,
    offset: int = 0,
    limit: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op (contract in ``__init__.py``)."""
    count = not isinstance(ids, torch.Tensor)
    require_same_device(tables, *[t for t in (None if count else ids, limit, prefix) if t is not None])
    rows = tables.shape[0]
    k = ids if count else ids.shape[1]
    p = 0 if prefix is None else prefix.shape[1]
    out = torch.empty(rows, p + k, dtype=torch.int64, device=tables.device)
    if out.numel():
        block, warps = _block(p + k)
        grid = (rows, triton.cdiv(p + k, block))
        ids_t = out if count else ids  # COUNT: never read
        table_ptr = tables if tables.numel() else out  # width 0: never read, any valid pointer
        pre = prefix if prefix is not None else out
        _paged_rows_kernel[grid](
            ids_t, table_ptr, limit if limit is not None else out, pre, out, k, p, tables.shape[1], rows_per_block,
            offset, ids_t.stride(0), ids_t.stride(1), tables.stride(0), tables.stride(1), pre.stride(0),
            pre.stride(1), COUNT=count, HAS_LIMIT=limit is not None, HAS_PREFIX=prefix is not None, BLOCK=block,
            num_warps=warps, **pdl_options(tables.device),
        )  # fmt: skip
    return out


def _scatter(table, rows, index, pos, ring: int, bias=None, bias_index=None) -> None:
    require_same_device(table, rows, index, pos, *([] if bias is None else [bias, bias_index]))
    b, c = rows.shape
    if b == 0 or c == 0:
        return
    block, warps = _block(c)
    has_bias = bias is not None
    _scatter_rows_kernel[(b, triton.cdiv(c, block))](
        table, rows, index.contiguous(), pos.contiguous(), bias if has_bias else rows,
        bias_index.contiguous() if has_bias else index, c, max(ring, 1), rows.stride(0), rows.stride(1),
        table.stride(0), bias.stride(0) if has_bias else 0, RING=ring > 0, HAS_BIAS=has_bias, BLOCK=block,
        num_warps=warps, **pdl_options(table.device),
    )  # fmt: skip


def scatter_rows_triton(table: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """The op (contract in ``__init__.py``)."""
    _scatter(table, rows, index, index, 0)


def ring_scatter_triton(
    buffer: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    bias: torch.Tensor | None = None,
    bias_index: torch.Tensor | None = None,
) -> None:
    """The op (contract in ``__init__.py``): ``buffer`` [S, R, C] as the flat table [S R, C]."""
    _scatter(buffer.view(-1, buffer.shape[-1]), rows, slots, pos, buffer.shape[1], bias, bias_index)


def gather_rows_triton(table: torch.Tensor, index: torch.Tensor, copies: int | None = None) -> torch.Tensor:
    """The op (contract in ``__init__.py``)."""
    require_same_device(table, index)
    b, c = index.shape[0], table.shape[1]
    out = torch.empty(b, copies or 1, c, dtype=table.dtype, device=table.device)
    if out.numel():
        block, warps = _block(c)
        _gather_rows_kernel[(b, triton.cdiv(c, block))](
            table, index.contiguous(), out, c, table.stride(0), COPIES=copies or 1, BLOCK=block, num_warps=warps,
            **pdl_options(table.device),
        )  # fmt: skip
    return out if copies is not None else out.view(b, c)


for _name, _fn in (
    ("gather_rows", gather_rows_triton),
    ("ring_rows", ring_rows_triton),
    ("paged_rows", paged_rows_triton),
    ("scatter_rows", scatter_rows_triton),
    ("ring_scatter", ring_scatter_triton),
):
    register_backend(
        _name, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )

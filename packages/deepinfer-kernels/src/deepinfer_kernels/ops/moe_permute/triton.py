"""Triton backends of ``moe_unpermute``, ``moe_sort`` and ``moe_sort_rows``.

``moe_unpermute``: one program per (token, column block) adds the token's k rows in slot order (a fixed order per
token: batch-invariant). The compiler may contract the weight multiply and the add into one FMA, so results can
differ from the reference in the last fp32 bit (tests allow that).

``moe_sort`` (up to ``SORT_MAX_PAIRS`` pairs, the decode sizes; more go to the reference's radix sort): a stable
counting sort in one launch, one program per chunk of CHUNK pairs. Each program loads the whole pair list at once and
takes two histograms of it: every pair (each expert's count, hence its first sorted row) and the pairs of the chunks
before its own; it places pair p of its chunk at its expert's first row plus the earlier chunks' pairs of that expert
plus p's rank among its own chunk's earlier pairs of that expert (a CHUNK x CHUNK comparison). Chunks do not wait
for each other (a single program walking the chunks in order took 50 us for the 1536 pairs of batch 256 on an H200),
and it replaces the argsort (a radix sort of 27 us at batch 64), gather, arange and searchsorted; integers only, so
the result equals the reference's exactly. Two whole-list histograms instead of one per 128-pair chunk, and 64-pair
chunks: 12.9 -> 7.0 us at batch 256, 6.0 -> 4.4 at 64, 4.5 -> 4.0 at 1 (H200, CUDA graphs, session 14 probe).
``moe_sort_rows_triton`` (the sorted-layout MoE's sort) also writes, from the same placement, each pair's sorted row
and each sorted row's token and routing weight: the order // k, weights[order] and inverse-order launches it replaces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.registry import register_backend

from .reference import inverse_order, moe_sort_ref, moe_sort_rows_ref

SORT_MAX_PAIRS = 4096  # (token, slot) pairs sorted in one program; a prefill's many more take the radix sort
SORT_CHUNK = 64


@triton.jit
def _unpermute_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, D, K_SLOTS, HAS_W: tl.constexpr, IDENTITY: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """out[t] = sum over slots i of y[pos[t * k + i]] (times w[t, i]); IDENTITY: pos = arange (y pair-major)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, K_SLOTS):
        if IDENTITY:
            row = t * K_SLOTS + i
        else:
            row = tl.load(pos_ptr + t * K_SLOTS + i)
        v = tl.load(y_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K_SLOTS + i).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_unpermute_triton(y, order, num_tokens, weights=None, out_dtype=None, *, inverse=None):
    """The op; ``inverse``: ``inverse_order(order)`` when the caller has it (``moe_sort_rows_triton``)."""
    p, d = y.shape
    k = p // num_tokens
    out = torch.empty(num_tokens, d, dtype=out_dtype or y.dtype, device=y.device)
    if d == 0:
        return out
    if inverse is not None:
        pos = inverse
    else:  # order None: y is pair-major already, the kernel reads its rows in order (no arange launch)
        pos = inverse_order(order) if order is not None else y
    w = weights.contiguous() if weights is not None else y
    block_d = min(1024, triton.next_power_of_2(d))
    _unpermute_kernel[(num_tokens, triton.cdiv(d, block_d))](
        y.contiguous(), pos, w, out, d, k, HAS_W=weights is not None, IDENTITY=order is None and inverse is None,
        BLOCK_D=block_d, num_warps=4,
        **pdl_options(y.device),
    )  # fmt: skip
    return out


@triton.jit
def _moe_sort_kernel(
    exp_ptr, order_ptr, off_ptr, run_ptr, w_ptr, inv_ptr, tok_ptr, rw_ptr, P, E, K_SLOTS,
    NB: tl.constexpr, CHUNK: tl.constexpr, PP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """ROWS: also each pair's sorted row (inv[pair]) and each sorted row's token and routing weight (tok[row] =
    pair // K_SLOTS, rw[row] = w[pair]): what a grouped GEMM over the sorted rows and the unpermute read."""
    pdl_prologue(PDL)
    c = tl.program_id(0)  # this program places the pairs of chunk c
    bins = tl.arange(0, NB)
    pair = tl.arange(0, PP)
    every = tl.load(exp_ptr + pair, mask=pair < P, other=E).to(tl.int32)  # bin E takes the lanes past P (NB > E)
    total = tl.histogram(every, NB)  # pairs per expert
    before = tl.histogram(every, NB, mask=pair < c * CHUNK)  # pairs per expert in the chunks before c
    start = tl.cumsum(total, 0) - total  # each expert's first sorted row; start[E] = P
    if c == 0:
        tl.store(off_ptr + bins, start.to(tl.int64), mask=bins <= E)
    tl.store(run_ptr + c * NB + bins, start + before)  # the chunk's first sorted row per expert
    tl.debug_barrier()  # every lane's bins are written before any lane reads one
    lane = tl.arange(0, CHUNK)
    c0 = c * CHUNK
    ok = c0 + lane < P
    e = tl.load(exp_ptr + c0 + lane, mask=ok, other=E).to(tl.int32)
    earlier = lane[None, :] < lane[:, None]
    rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)  # earlier lanes of one expert
    dst = tl.load(run_ptr + c * NB + e) + rank
    pair_id = (c0 + lane).to(tl.int64)
    tl.store(order_ptr + dst, pair_id, mask=ok)
    if ROWS:
        tl.store(inv_ptr + pair_id, dst.to(tl.int64), mask=ok)
        tl.store(tok_ptr + dst, pair_id // K_SLOTS, mask=ok)
        tl.store(rw_ptr + dst, tl.load(w_ptr + pair_id, mask=ok, other=0.0), mask=ok)


def moe_sort_triton(experts: torch.Tensor, num_experts: int):
    """The op (contract in ``__init__.py``)."""
    return _sort(experts, num_experts, None)[:2]


def moe_sort_rows_triton(experts: torch.Tensor, weights: torch.Tensor, num_experts: int):
    """``moe_sort`` plus what the sorted-layout MoE reads beside it, in the same launch: (order, offsets, inverse
    [P] int64 (inverse[order[j]] = j, for ``moe_unpermute_triton``), row_token [P] int64 (= order // k, the token of
    each sorted row), row_weight [P] fp32 (= weights.flatten()[order])), all exactly the torch expressions'
    values. experts [T, k] integer ids, weights [T, k] (routing weights, read as fp32)."""
    return _sort(experts, num_experts, weights)


def _sort(experts: torch.Tensor, num_experts: int, weights: torch.Tensor | None):
    flat = experts.reshape(-1)
    p = flat.shape[0]
    if p > SORT_MAX_PAIRS or p == 0:
        if weights is None:
            return moe_sort_ref(experts, num_experts)
        return moe_sort_rows_ref(experts, weights, num_experts)
    nb = triton.next_power_of_2(num_experts + 1)
    order = torch.empty(p, dtype=torch.int64, device=flat.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    chunks = triton.cdiv(p, SORT_CHUNK)
    running = torch.empty(chunks, nb, dtype=torch.int32, device=flat.device)
    rows = weights is not None
    if rows:
        w = weights.reshape(-1).float().contiguous()
        inverse, row_token = torch.empty_like(order), torch.empty_like(order)
        row_weight = torch.empty(p, dtype=torch.float32, device=flat.device)
    else:
        w = inverse = row_token = row_weight = order  # dummy pointers, never read or written
    _moe_sort_kernel[(chunks,)](
        flat.contiguous(), order, offsets, running, w, inverse, row_token, row_weight, p, num_experts,
        experts.shape[1], NB=nb, CHUNK=SORT_CHUNK, PP=triton.next_power_of_2(p), ROWS=rows, num_warps=4,
        **pdl_options(flat.device),
    )  # fmt: skip
    return (order, offsets, inverse, row_token, row_weight) if rows else (order, offsets)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


register_backend(
    "moe_unpermute", "triton", moe_unpermute_triton, devices=("cuda",), priority=20, available=_cuda_available,
    batch_invariant=True,
)  # fmt: skip
register_backend(
    "moe_sort", "triton", moe_sort_triton, devices=("cuda",), priority=20, available=_cuda_available,
    batch_invariant=True,
)  # fmt: skip
register_backend(
    "moe_sort_rows", "triton", moe_sort_rows_triton, devices=("cuda",), priority=20, available=_cuda_available,
    batch_invariant=True,
)  # fmt: skip

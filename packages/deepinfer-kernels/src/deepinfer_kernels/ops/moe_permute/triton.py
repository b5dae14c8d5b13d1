"""Triton backends of ``moe_unpermute`` and ``moe_sort``.

``moe_unpermute``: one program per (token, column block) adds the token's k rows in slot order (a fixed order per
token: batch-invariant). The compiler may contract the weight multiply and the add into one FMA, so results can
differ from the reference in the last fp32 bit (tests allow that).

``moe_sort`` (up to ``SORT_MAX_PAIRS`` pairs, the decode sizes; more go to the reference's radix sort): a stable
counting sort in one program. A histogram pass gives each expert's count and offset; a second pass walks the pairs
in chunks of CHUNK in order and places pair p at its expert's running position plus its rank among the chunk's
earlier pairs of that expert (a CHUNK x CHUNK comparison), then advances the running positions by the chunk's
histogram. One launch instead of the argsort (a radix sort of 27 us at batch 64 on an H200), gather, arange and
searchsorted; integers only, so the result equals the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.registry import register_backend

from .reference import inverse_order, moe_sort_ref

SORT_MAX_PAIRS = 4096  # (token, slot) pairs sorted in one program; a prefill's many more take the radix sort
SORT_CHUNK = 128


@triton.jit
def _unpermute_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, D, K_SLOTS, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, K_SLOTS):
        row = tl.load(pos_ptr + t * K_SLOTS + i)
        v = tl.load(y_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K_SLOTS + i).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_unpermute_triton(y, order, num_tokens, weights=None, out_dtype=None):
    p, d = y.shape
    k = p // num_tokens
    out = torch.empty(num_tokens, d, dtype=out_dtype or y.dtype, device=y.device)
    if d == 0:
        return out
    pos = inverse_order(order) if order is not None else torch.arange(p, device=y.device)
    w = weights.contiguous() if weights is not None else y
    block_d = min(1024, triton.next_power_of_2(d))
    _unpermute_kernel[(num_tokens, triton.cdiv(d, block_d))](
        y.contiguous(), pos, w, out, d, k, HAS_W=weights is not None, BLOCK_D=block_d, num_warps=4
    )
    return out


@triton.jit
def _moe_sort_kernel(exp_ptr, order_ptr, off_ptr, run_ptr, P, E, NB: tl.constexpr, CHUNK: tl.constexpr):
    bins = tl.arange(0, NB)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros([NB], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):  # bin E takes the lanes past P (NB > E)
        e = tl.load(exp_ptr + c0 + lane, mask=c0 + lane < P, other=E).to(tl.int32)
        counts += tl.histogram(e, NB)
    running = tl.cumsum(counts, 0) - counts  # each expert's first sorted row; running[E] = P
    tl.store(off_ptr + bins, running.to(tl.int64), mask=bins <= E)
    tl.store(run_ptr + bins, running)
    tl.debug_barrier()
    earlier = lane[None, :] < lane[:, None]
    for c0 in range(0, P, CHUNK):
        ok = c0 + lane < P
        e = tl.load(exp_ptr + c0 + lane, mask=ok, other=E).to(tl.int32)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        base = tl.load(run_ptr + e)
        tl.store(order_ptr + base + rank, (c0 + lane).to(tl.int64), mask=ok)
        running += tl.histogram(e, NB)
        tl.debug_barrier()  # every lane has read this chunk's positions before they advance
        tl.store(run_ptr + bins, running)
        tl.debug_barrier()


def moe_sort_triton(experts: torch.Tensor, num_experts: int):
    """The op (contract in ``__init__.py``)."""
    flat = experts.reshape(-1)
    p = flat.shape[0]
    if p > SORT_MAX_PAIRS or p == 0:
        return moe_sort_ref(experts, num_experts)
    nb = triton.next_power_of_2(num_experts + 1)
    order = torch.empty(p, dtype=torch.int64, device=flat.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    running = torch.empty(nb, dtype=torch.int32, device=flat.device)
    _moe_sort_kernel[(1,)](
        flat.contiguous(), order, offsets, running, p, num_experts, NB=nb, CHUNK=SORT_CHUNK, num_warps=4
    )
    return order, offsets


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

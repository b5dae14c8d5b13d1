"""``linear_many`` in one launch at decode sizes (CUDA backend ``triton_skinny``): every weight's column blocks in
one grid, each program running ``linear``'s skinny tile (``ops/linear/triton_skinny.py``: one 16-row tensor-core
tile of x against a [32, K_SPLIT] weight block, fp32 partials, the last program of a column block adds the K
splits in split order). At decode a small projection costs its launch and ramp (4-6 us for a 2-8 MB weight on an
H200), not its bytes; an attention layer reads its normed input with up to seven of them.

Serves at most ``SKINNY_MAX_ROWS`` rows of bf16 / fp16 x, up to ``MAX_PARTS`` weights of x's dtype, each at most
``MAX_PART_N`` rows; anything else runs the per-weight loop (``linear`` each). Deterministic (fixed tiling and
split order per shape) but, like the skinny ``linear``, not batch-invariant: batch-invariant mode takes the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, triton_cuda_available
from deepinfer_kernels.ops.linear.triton_skinny import (
    BLOCK_K,
    BLOCK_M,
    COUNTERS,
    K_SPLIT,
    SKINNY_MAX_ROWS,
    counter_block,
    skinny_tile,
)
from deepinfer_kernels.registry import register_backend

from .reference import linear_many_loop

MAX_PARTS = 8  # weights one launch takes (the kernel has a fixed argument list)
MAX_PART_N = 4096  # rows of one weight; wider ones (q up-projections, 16-64 MB) are bandwidth-bound on their own
BLOCK_N = 32


@triton.jit
def _part(
    x_ptr, w_ptr, o_ptr, n, lo, hi, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    if (pid_n >= lo) & (pid_n < hi):  # this program's column block belongs to the weight of tiles [lo, hi)
        skinny_tile(
            x_ptr, w_ptr, o_ptr, ws_ptr, cnt_ptr + pid_n, pid_n - lo, tl.program_id(1), M, n, K, K_SPLIT, SPLIT,
            WS_N, lo * BLOCK_N, BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT,
        )  # fmt: skip


@triton.jit
def _many_kernel(
    x_ptr, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N,
    w0, o0, n0, e0, w1, o1, n1, e1, w2, o2, n2, e2, w3, o3, n3, e3,
    w4, o4, n4, e4, w5, o5, n5, e5, w6, o6, n6, e6, w7, o7, n7, e7,
    PARTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Weight p owns column blocks [e_{p-1}, e_p) of the grid (e_{-1} = 0) and writes o_p (its own dtype)."""
    pdl_prologue(PDL)
    _part(x_ptr, w0, o0, n0, 0, e0, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 1:
        _part(x_ptr, w1, o1, n1, e0, e1, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 2:
        _part(x_ptr, w2, o2, n2, e1, e2, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 3:
        _part(x_ptr, w3, o3, n3, e2, e3, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 4:
        _part(x_ptr, w4, o4, n4, e3, e4, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 5:
        _part(x_ptr, w5, o5, n5, e4, e5, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 6:
        _part(x_ptr, w6, o6, n6, e5, e6, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)
    if PARTS > 7:
        _part(x_ptr, w7, o7, n7, e6, e7, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, BM, BN, BK, F32_DOT)


def serves(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> bool:
    """Whether ``linear_many_skinny`` takes the call in one launch (else the per-weight loop)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return (
        0 < m <= SKINNY_MAX_ROWS
        and k > 0
        and len(weights) <= MAX_PARTS
        and x.dtype in (torch.bfloat16, torch.float16)
        and all(w.dtype == x.dtype and 0 < w.shape[0] <= MAX_PART_N for w in weights)
        and all(dt in (None, torch.float32) for dt in out_dtypes)
        and sum(triton.cdiv(w.shape[0], BLOCK_N) for w in weights) <= COUNTERS
    )


def linear_many_skinny(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> list[torch.Tensor]:
    """``linear_many`` in one launch where ``serves`` says so; the per-weight loop otherwise."""
    if not serves(x, weights, out_dtypes):
        return linear_many_loop(x, weights, out_dtypes)
    k = x.shape[-1]
    lead = x.shape[:-1]
    a = x.reshape(-1, k).contiguous()
    m = a.shape[0]
    k_split = min(K_SPLIT, triton.cdiv(k, BLOCK_K) * BLOCK_K)
    split = triton.cdiv(k, k_split)
    mats = [w.contiguous() for w in weights]
    outs = [torch.empty(m, w.shape[0], dtype=dt or x.dtype, device=x.device) for w, dt in zip(mats, out_dtypes)]
    ends, total = [], 0
    for w in mats:
        total += triton.cdiv(w.shape[0], BLOCK_N)
        ends.append(total)
    ws = torch.empty(split, m, total * BLOCK_N, dtype=torch.float32, device=x.device) if split > 1 else outs[0]
    parts = []
    for p in range(MAX_PARTS):  # unused slots repeat the first weight; PARTS keeps them out of the kernel
        q = p if p < len(mats) else 0
        parts += [mats[q], outs[q], mats[q].shape[0], ends[q] if p < len(mats) else total]
    _many_kernel[(total, split)](
        a, ws, counter_block(x.device), m, k, k_split, split, total * BLOCK_N, *parts,
        PARTS=len(mats), BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, F32_DOT=interpreting(),
        num_warps=4, num_stages=4, **pdl_options(a.device),
    )  # fmt: skip
    return [o.reshape(*lead, o.shape[1]) for o in outs]


register_backend(
    "linear_many", "triton_skinny", linear_many_skinny, devices=("cuda",), priority=30,
    available=triton_cuda_available, batch_invariant=False,
)  # fmt: skip

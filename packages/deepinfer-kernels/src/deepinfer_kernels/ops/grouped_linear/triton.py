"""The batch-invariant GPU backend of ``grouped_linear``; ``cublas.py`` has the other.

* ``triton_fixed``: ``linear``'s ``triton_fixed`` kernel made grouped: the same BLOCK_M x BLOCK_N tiles with K
  walked in BLOCK_K steps in order and a fixed-order sum of the K-split partials, one launch for all G groups
  (grid axis 0 walks the N tiles of one group, then the next group's; axis 1 the M tiles; axis 2 the K split).
  Block sizes and the K split come from ``linear``'s ``_config`` for the [G * Dout, Din] weight seen as one
  matrix, so from (G, Dout, Din, dtype) alone and never from T: a row's bits depend on its own data only
  (registered ``batch_invariant=True``; the GPU tests check one row alone against the same row inside 64 and
  4096). fp32 inputs use IEEE fp32 products (no TF32), like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.ops.linear.triton import _config as _linear_config
from deepinfer_kernels.ops.split_k import split_output, store_split_tile
from deepinfer_kernels.registry import register_backend


# M is not specialised: one binary serves every M, so the bits of a row cannot change with the batch size
@triton.jit(do_not_specialize=["M"])
def _grouped_linear_kernel(
    x_ptr, w_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, G, N, K, K_PER_SPLIT, x_stride_m, x_stride_g,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SUM_IN_KERNEL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # c is [M, G, N] (parts: [SPLIT, M, G, N]); x[:, g] is [M, K] with row stride x_stride_m; W_g rows are weight
    # rows g*N..g*N+N-1
    n_tiles = tl.cdiv(N, BLOCK_N)
    g = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_row = x_ptr + g.to(tl.int64) * x_stride_g + rm[:, None] * x_stride_m
    b_row = w_ptr + (g.to(tl.int64) * N + rn[:, None]) * K
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        a = tl.load(a_row + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_row + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32_DOT:  # fp32 inputs; or the CPU interpreter, whose bf16 dot is wrong (fp32 products are exact)
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    tile = pid_m * tl.num_programs(0) + tl.program_id(0)
    store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr + tile, pid_k, (rm[:, None] * G + g) * N + rn[None, :],
                     m_ok[:, None] & n_ok[None, :], tl.cast(M, tl.int64) * G * N, SPLIT, SUM_IN_KERNEL)  # fmt: skip


def grouped_linear_triton_fixed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grouped_linear`` with one tiling per (G, Dout, Din) for every T (batch-invariant), one GEMM launch."""
    m, g, k = x.shape
    n = weight.shape[0] // g
    w = weight.to(x.dtype).contiguous()
    require_same_device(x, w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    c = torch.empty(m, g, n, dtype=x.dtype, device=x.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    bm, bn, bk, split, warps, stages = _linear_config(g * n, k, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, bk), split) * bk  # whole BLOCK_K steps per split
    grid = (g * triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    out = split_output(c, split, grid[0] * grid[1])
    _grouped_linear_kernel[grid](
        x, w, c, out.ws, out.counters, m, g, n, k, k_per_split, x.stride(0), x.stride(1),
        F32_DOT=x.dtype == torch.float32 or interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split, SUM_IN_KERNEL=out.in_kernel, num_warps=warps, num_stages=stages, **pdl_options(x.device),
    )  # fmt: skip
    return out.finish()


register_backend(
    "grouped_linear",
    "triton_fixed",
    grouped_linear_triton_fixed,
    devices=("cuda",),
    priority=10,
    available=triton_cuda_available,
    batch_invariant=True,
)

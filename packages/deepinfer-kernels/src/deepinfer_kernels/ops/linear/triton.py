"""The batch-invariant GPU backend of ``linear`` (y = x W^T in x's dtype, or fp32); ``cublas.py`` has the other.

* ``triton_fixed``: one tiling per (N, K) whatever M is (BLOCK_M x BLOCK_N tiles, K walked in BLOCK_K steps in
  order, and a K split chosen from (N, K) alone whose partial sums are added in a fixed order): a row's bits
  depend on its own data only, so it is registered ``batch_invariant=True`` (the GPU tests check one row alone
  against the same row inside 64 and 4096). fp32 inputs use IEEE fp32 products (no TF32), like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, triton_cuda_available
from deepinfer_kernels.ops.split_k import k_split, split_output, store_split_tile
from deepinfer_kernels.registry import register_backend


# M is not specialised: one binary serves every M, so the bits of a row cannot change with the batch size
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT,
    F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SUM_IN_KERNEL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # axis 0 walks N (consecutive programs share A rows in L2 while W streams), axis 2 is the K split
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        a = tl.load(a_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32_DOT:  # fp32 inputs; or the CPU interpreter, whose bf16 dot is wrong (fp32 products are exact)
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    tile = pid_m * tl.num_programs(0) + pid_n
    store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr + tile, pid_k, rm[:, None] * N + rn[None, :],
                     m_ok[:, None] & n_ok[None, :], tl.cast(M, tl.int64) * N, SPLIT, SUM_IN_KERNEL)  # fmt: skip


def _config(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) from (N, K, dtype) only. The K split gives a
    decode-size GEMM about two programs per SM (otherwise N / BLOCK_N programs stream the whole weight)."""
    fp32 = dtype == torch.float32
    block_m, block_n, block_k = 64, (128 if n >= 4096 else 64), (32 if fp32 else 64)
    split = k_split(-(-n // block_n), k // block_k, programs_per_sm=2, min_steps=4, max_split=8)
    return block_m, block_n, block_k, split, 4, (3 if fp32 else 4)


def linear_triton_fixed(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``linear`` with one tiling per (N, K) for every M (batch-invariant). With ``out_dtype`` the bf16 / fp16 tiles
    meet on the tensor cores (fp32 accumulation, as always) and the result is stored in fp32."""
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    a = x.reshape(-1, k).contiguous()
    m = a.shape[0]
    c = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return c.reshape(*lead, n)
    if k == 0:
        return c.zero_().reshape(*lead, n)
    bm, bn, bk, split, warps, stages = _config(n, k, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, bk), split) * bk  # whole BLOCK_K steps per split
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    out = split_output(c, split, grid[0] * grid[1])
    _linear_kernel[grid](
        a, weight.to(x.dtype).contiguous(), c, out.ws, out.counters, m, n, k, k_per_split,
        F32_DOT=x.dtype == torch.float32 or interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split, SUM_IN_KERNEL=out.in_kernel, num_warps=warps, num_stages=stages, **pdl_options(a.device),
    )  # fmt: skip
    return out.finish().reshape(*lead, n)


register_backend(
    "linear",
    "triton_fixed",
    linear_triton_fixed,
    devices=("cuda",),
    priority=10,
    available=triton_cuda_available,
    batch_invariant=True,
)

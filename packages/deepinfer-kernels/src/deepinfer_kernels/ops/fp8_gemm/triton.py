"""Triton backends of ``fp8_gemm_nt`` (DeepGEMM-style block-scaled FP8 GEMM for Hopper, sm_90).

Each program owns a BLOCK_M x BLOCK_N tile of C and walks K in steps of ``block`` (the scale granularity,
128 or 32): an FP8 ``tl.dot`` with fp32 accumulation gives the step's partial product, which is multiplied
by a_scale[m, kb] * b_scale[n // block, kb] and added to the fp32 accumulator. The reduction order of every
element is fixed by the tiling.

Two registrations:

* ``triton_fixed`` uses one tiling per (N, K) whatever M is, including a fixed split of K for narrow outputs
  (the splits are added in a fixed order, ``split_k.store_split_tile``): a row's bits depend on its own data only, so it
  is registered ``batch_invariant=True`` (the GPU tests check M = 1 against M = 64 bitwise);
* ``triton`` is the same up to 64 rows; above, its K split counts the row tiles too (MULTI_TILE_PROGRAMS_PER_SM),
  so it shrinks to none at prefill sizes (no fp32 workspace traffic there) and its bits change with M: not
  declared batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, sm90_or_newer
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.ops.split_k import k_split, split_output, store_split_tile
from deepinfer_kernels.registry import register_backend


# M is not specialised: Triton would otherwise compile a separate kernel for M == 1 (measured 4x slower than
# M = 64 on the same weights), and one binary for every M keeps the batch-invariant variant's code identical
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_nt_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, cnt_ptr,
    M, N, K, KB_PER_SPLIT,
    SB: tl.constexpr,  # scale block along K (and along N for b)
    A_E8M0: tl.constexpr, B_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, SUM_IN_KERNEL: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # axis 0 walks N so that consecutive programs share the same A rows (A stays in L2, B streams);
    # axis 2 is the K split: split s covers K-blocks [s * KB_PER_SPLIT, (s + 1) * KB_PER_SPLIT)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, SB)
    m_ok = rm < M
    n_ok = rn < N
    kb_count = K // SB
    kb_lo = pid_k * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, kb_count)
    a_ptrs = a_ptr + rm[:, None] * K + (kb_lo * SB + rk)[None, :]
    b_ptrs = b_ptr + rn[:, None] * K + (kb_lo * SB + rk)[None, :]
    as_ptrs = as_ptr + rm * kb_count
    bs_ptrs = bs_ptr + (rn // SB) * kb_count
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        part = tl.dot(a, tl.trans(b))  # fp8 x fp8 -> fp32
        sa = tl.load(as_ptrs + kb, mask=m_ok, other=0)
        sb = tl.load(bs_ptrs + kb, mask=n_ok, other=0)
        if A_E8M0:
            sa = e8m0_to_f32(sa)
        if B_E8M0:
            sb = e8m0_to_f32(sb)
        acc += part * (sa[:, None] * sb[None, :])
        a_ptrs += SB
        b_ptrs += SB
    # SPLIT > 1: parts in the fp32 workspace [SPLIT, M, N], added in split order by the tile's last program
    tile = pid_m * tl.num_programs(0) + pid_n
    store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr + tile, pid_k, rm[:, None] * N + rn[None, :],
                     m_ok[:, None] & n_ok[None, :], tl.cast(M, tl.int64) * N, SPLIT, SUM_IN_KERNEL)  # fmt: skip


# Above 64 rows the K split is sized from every output tile (N tiles x M tiles) to about this many programs an
# SM. Measured on an H100 (session 33, cold L2, us at 256 rows, no split -> this rule): wq_a 33.5 -> 20.4,
# wkv 34.2 -> 11.4, wo_b 108.5 -> 86.9, w13 61.5 -> 54.6, w2 28.7 -> 27.5, V4 wo_b 34.5 -> 32.1; wq_b (1024
# tiles) and prefill sizes stay unsplit. At 2 an SM (the decode rule) wo_b/w13/w2 stayed unsplit; at 4, V4
# wo_b split 4 (39.4). 0: no split above 64 rows (the rule before session 33).
MULTI_TILE_PROGRAMS_PER_SM = 3


def _config(m: int | None, n: int, k: int, block: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT, num_warps, num_stages). ``m`` None (the batch-invariant variant) or at most 64
    rows: from (N, K) only; above 64 rows the split also counts the row tiles.

    BLOCK_M = 64 (one wgmma warpgroup; measured no faster at 128 for prefill). The K split gives a one-row
    (decode) GEMM about two programs per SM: otherwise N / BLOCK_N programs (10 for wkv) stream the weights.
    """
    block_m = 64
    block_n = 128 if n >= 4096 else 64
    n_tiles = -(-n // block_n)
    if m is None or m <= block_m:
        split = k_split(n_tiles, k // block, programs_per_sm=2, min_steps=4, max_split=8)
    else:
        tiles = n_tiles * -(-m // block_m)
        split = k_split(tiles, k // block, programs_per_sm=MULTI_TILE_PROGRAMS_PER_SM, min_steps=4, max_split=8)
    return block_m, block_n, split, 4, 4 if block == 128 else 6


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if s.dtype == torch.float32:
        return s.contiguous(), False
    return s.contiguous().view(torch.uint8), True  # float8_e8m0fnu / uint8: raw exponent bytes


def _launch(a, a_scale, b, b_scale, block, out_dtype, fixed: bool) -> torch.Tensor:
    k = a.shape[-1]
    n = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c.reshape(*lead, n)
    if k == 0:
        return c.zero_().reshape(*lead, n)
    sa, a_e8m0 = _scale_arg(a_scale.reshape(m, k // block))
    sb, b_e8m0 = _scale_arg(b_scale)
    bm, bn, split, warps, stages = _config(None if fixed else m, n, k, block)
    kb_per_split = -(-(k // block) // split)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    out = split_output(c, split, grid[0] * grid[1])
    _fp8_gemm_nt_kernel[grid](
        a2, sa, b.contiguous(), sb, c, out.ws, out.counters, m, n, k, kb_per_split,
        SB=block, A_E8M0=a_e8m0, B_E8M0=b_e8m0, BLOCK_M=bm, BLOCK_N=bn, SPLIT=split, SUM_IN_KERNEL=out.in_kernel,
        num_warps=warps, num_stages=stages, **pdl_options(a2.device),
    )  # fmt: skip
    return out.finish().reshape(*lead, n)


def fp8_gemm_nt_triton(a, a_scale, b, b_scale, block=128, out_dtype=torch.bfloat16):
    """``fp8_gemm_nt`` with BLOCK_M chosen from M (not batch-invariant)."""
    return _launch(a, a_scale, b, b_scale, block, out_dtype, fixed=False)


def fp8_gemm_nt_triton_fixed(a, a_scale, b, b_scale, block=128, out_dtype=torch.bfloat16):
    """``fp8_gemm_nt`` with one tiling per (N, K) for every M (batch-invariant)."""
    return _launch(a, a_scale, b, b_scale, block, out_dtype, fixed=True)


def cuda_fp8_available() -> bool:
    """Triton imported (it did, or this module would not load), a CUDA GPU of compute capability >= 9.0."""
    return sm90_or_newer()


register_backend(
    "fp8_gemm_nt", "triton", fp8_gemm_nt_triton, devices=("cuda",), priority=20, available=cuda_fp8_available
)
register_backend(
    "fp8_gemm_nt",
    "triton_fixed",
    fp8_gemm_nt_triton_fixed,
    devices=("cuda",),
    priority=10,
    available=cuda_fp8_available,
    batch_invariant=True,
)

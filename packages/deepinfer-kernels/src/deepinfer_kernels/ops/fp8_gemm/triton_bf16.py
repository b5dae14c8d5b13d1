"""``fp8_gemm_nt`` as a bf16 GEMM of exactly dequantised operands, for UE8M0 (power-of-two) scales: a Triton
kernel for decode batches of a few dozen to a few hundred rows.

Why: the block-scaled kernel (``triton.py``) multiplies its whole fp32 accumulator by the scales after every K
block, and with V4.1's 32-wide blocks that CUDA-core work sits between every pair of 32-deep FP8 MMAs. An e4m3 value
times a power of two has 4 significant bits and fits bf16 exactly, so here the scales go into the operands instead:

* the activations are dequantised to bf16 once, before the GEMM (``act_dequant_fp8``: M x K x 2 bytes, small
  beside the weights at these sizes), not once per output tile;
* the weight tile is loaded as FP8, multiplied by its 32 x 32 (or 128 x 128) block scales in fp32 and cast to
  bf16 in registers (exact), then multiplied by the activation tile with fp32 accumulation and no rescale;
* weights are the MMA's wide operand (``tl.dot(w, x^T)``: C^T tiles of BLOCK_N weight rows x BLOCK_M
  activation rows), so a decode batch fills the MMA's N and Triton keeps the converted weights in registers.

Every product is exact and the sums are fp32, so results differ from the reference only in summation order. The
K split (``split_k``) is chosen from (M, N, K): not batch-invariant. Used by ``gluon.py`` between
GLUON_MAX_M and BF16_MAX_M rows when both scales are UE8M0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options
from deepinfer_kernels.ops.quant import act_dequant_fp8
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.ops.split_k import k_split, split_output, store_split_tile


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_nt_bf16_kernel(
    x_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, STEPS_PER_SPLIT,
    SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
    SPLIT: tl.constexpr, SUM_IN_KERNEL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (pid_n, pid_m, pid_k): c[BLOCK_M pid_m .., BLOCK_N pid_n ..] over K steps [pid_k * SPS, + SPS) of
    BK; with a K split, parts in the fp32 workspace [SPLIT, M, N] (``split_k.store_split_tile``). x: [M, K] bf16
    (dequantised activations), b: [N, K] e4m3, bs: [ceil(N / SB), K / SB] UE8M0 bytes. F32_DOT: the same
    (bf16-valued) operands multiplied as fp32, for Triton's interpreter, whose bf16 ``tl.dot`` reads the raw bits
    as integers (Triton 3.6)."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    NB: tl.constexpr = BK // SB if SB < BK else 1  # scale blocks a step
    kb = tl.arange(0, NB)
    rk = tl.arange(0, BK)
    w_rows = _clamped_rows(rn, N)
    w_ptrs = b_ptr + w_rows * K + rk[None, :]
    x_ptrs = x_ptr + _clamped_rows(rm, M) * K + rk[None, :]
    s_rows = bs_ptr + (w_rows // SB) * (K // SB)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    s_lo = pid_k * STEPS_PER_SPLIT
    s_hi = tl.minimum(s_lo + STEPS_PER_SPLIT, K // BK)
    for s in range(s_lo, s_hi):
        k0 = s * BK
        w = tl.load(w_ptrs + k0).to(tl.float32)
        sc = e8m0_to_f32(tl.load(s_rows + (k0 // SB + kb)[None, :]))  # [BLOCK_N, NB]
        if NB == 1:
            wb = (w * sc).to(tl.bfloat16)
        else:
            wb = tl.reshape(tl.reshape(w, (BLOCK_N, NB, BK // NB)) * sc[:, :, None], (BLOCK_N, BK)).to(tl.bfloat16)
        x = tl.load(x_ptrs + k0)
        if F32_DOT:
            acc = tl.dot(wb.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
        else:
            acc = tl.dot(wb, tl.trans(x), acc)
    tile = pid_m * tl.num_programs(0) + pid_n
    store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr + tile, pid_k, rm.to(tl.int64)[None, :] * N + rn[:, None],
                     n_ok[:, None] & m_ok[None, :], tl.cast(M, tl.int64) * N, SPLIT, SUM_IN_KERNEL)  # fmt: skip


@triton.jit
def _clamped_rows(r, R):
    """int64 [R, 1] row offsets, rows past R clamped to the last (recomputed, never stored: unmasked loads)."""
    return tl.minimum(r, R - 1).to(tl.int64)[:, None]


BK = 64
BLOCK_N = 128
PROGRAMS_PER_SM = 2


def bf16_config(m: int, n: int, k: int) -> dict:
    """Tiling, pipeline depth and K split of an [m, k] x [n, k]^T GEMM."""
    block_m = min(128, max(32, triton.next_power_of_2(m)))
    block_n = BLOCK_N if n >= 2048 else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = k_split(tiles, k // BK, programs_per_sm=PROGRAMS_PER_SM, min_steps=4, max_split=16)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BK": BK, "split": split, "num_warps": 4, "num_stages": 4}


def fp8_gemm_nt_triton_bf16(a, a_scale, b, b_scale, block=32, out_dtype=torch.bfloat16, cfg: dict | None = None):
    """``fp8_gemm_nt`` for UE8M0 scales on both operands (float8_e8m0fnu or uint8; exactness needs powers of two)
    and K a multiple of BK: a [..., K] e4m3, a_scale [..., K / block], b [N, K] e4m3, b_scale [ceil(N / block),
    K / block]. ``cfg`` overrides ``bf16_config``."""
    k = a.shape[-1]
    n = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    m = a2.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c.reshape(*lead, n)
    x = act_dequant_fp8(a2, a_scale.reshape(m, k // block), block, torch.bfloat16)
    cfg = cfg or bf16_config(m, n, k)
    split, bk = cfg["split"], cfg["BK"]
    steps = k // bk
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    out = split_output(c, split, grid[0] * grid[1])
    _fp8_gemm_nt_bf16_kernel[grid](
        x, b.contiguous(), b_scale.contiguous().view(torch.uint8), c, out.ws, out.counters, m, n, k,
        -(-steps // split), SB=block, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BK=bk, F32_DOT=interpreting(),
        SPLIT=split, SUM_IN_KERNEL=out.in_kernel, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_options(a.device),
    )  # fmt: skip
    return out.finish().reshape(*lead, n)

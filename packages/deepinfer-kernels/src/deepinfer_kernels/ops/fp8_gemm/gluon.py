"""Gluon backend of ``fp8_gemm_nt`` for MXFP8 (block 32, V4.1-Flash's dense weights) at decode sizes (M <=
GLUON_MAX_M rows): the weights stream through ``mma.sync`` as the wide A operand, the few activation rows are the B
operand's 8 columns (sm_90, where it was tuned and tested: the H200). The registered backend also routes the other
sizes: with UE8M0 scales on both operands, up to BF16_MAX_M rows the in-kernel dequant kernel (``triton_bf16.py``)
and from DEQUANT_MM_FROM_M rows (32-blocks) dequantise + cuBLAS (``dequant_mm.py``); everything else to the
Triton kernel.

Why: at a few rows the Triton kernel (``triton.py``) is a weight stream at 5-45% of copy (``bench_fp8_gemm.py``),
its 64 x 128 tiles mostly padding and its fp32 accumulator rescaled every K block of 32.

* A program owns BLOCK_N = 64 weight rows (16 a warp) and 8 rows of ``a``; a thread loads 8 consecutive FP8 bytes
  of a row (one 64-bit load; ``k_width`` 8, the same K order for both operands) and the step's 4 K blocks of 32 are
  loaded before any is used (8 KB in flight a program).
* FP8 e4m3 -> fp16 is exact (``cvt.rn.f16x2.e4m3x2``, two values an instruction), so the MMA is fp16 x fp16 with
  exact products and fp32 sums; the scales multiply each K block's [64, 8] partial product (b_scale of its rows
  times a_scale of its columns) as the op's definition reads, cheap at 8 columns.
* K is split for up to ~16 programs an SM (``_split``, from N and K only; ~4 an SM was 10-15% slower than Triton),
  the fp32 parts added in a fixed order (``split_k.store_split_tile``: by the tile's last program at one row, else
  by a second launch; the same bits): an output row depends only on its own activation row and the tiling not on
  M, so the kernel is batch-invariant; the registration is not (M picks this kernel or Triton's).

Scales: a_scale and b_scale in fp32, UE8M0 bytes or float8_e8m0fnu, any value (they multiply fp32 partials).
Measured on an H200 (session 30, one row, CUDA graphs after a 256 MB copy, us Triton -> this): wo_b (5120 x 8192)
32.2 -> 27.3, shared w13 (4608 x 5120) 20.3 -> 15.0, wq_b (32768 x 1280) 22.5 -> 22.5, wq_a (1280 x 5120) 10.9 ->
10.8; V4's 128-blocks (wq_b 32768 x 1024) were slower here (12.1 -> 17.1) and stay in Triton. Still ~30-45% of
copy: one 8 KB step in flight a program, no cross-step prefetch.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.quant.formats import is_ue8m0
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.ops.split_k import k_split, split_output, store_split_tile
from deepinfer_kernels.registry import register_backend

from .dequant_mm import fp8_gemm_nt_dequant_mm
from .triton import _scale_arg, cuda_fp8_available, fp8_gemm_nt_triton
from .triton_bf16 import BK as BF16_BK
from .triton_bf16 import fp8_gemm_nt_triton_bf16


@gluon.jit
def _scale_f32(ptr, offs, mask, E8M0: gl.constexpr):
    """fp32 scales at ``ptr + offs``: UE8M0 bytes (2^(e-127); 0 -> 2^-127, 255 -> NaN) or fp32 values."""
    if E8M0:
        s = e8m0_to_f32(gl.load(ptr + offs, mask=mask, other=127))  # a triton.jit helper: Gluon calls it
    else:
        s = gl.load(ptr + offs, mask=mask, other=1.0)
    return s


@gluon.jit
def _scaled_add(acc, w, x, bs_ptr, bs_rows, as_ptr, as_cols, kb, n_ok, m_ok, A_E8M0: gl.constexpr,
                B_E8M0: gl.constexpr):  # fmt: skip
    """acc + (w . x) * b_scale[row block, kb] * a_scale[column, kb]: one K block of 32 (fp16 MMA, exact products)."""
    part = mma_v2(w.to(gl.float16), x.to(gl.float16), gl.zeros_like(acc))
    sb = _scale_f32(bs_ptr, bs_rows + kb, n_ok, B_E8M0)
    sa = _scale_f32(as_ptr, as_cols + kb, m_ok, A_E8M0)
    return acc + part * (sb[:, None] * sa[None, :])


@gluon.jit
def _loads4(w_rows, x_cols, k0, kw, kx):
    """The weight and activation tiles of K blocks k0 / 32 .. + 3: [BLOCK_N, 32] and [32, 8] e4m3 each."""
    w0 = gl.load(w_rows[:, None] + (k0 + kw)[None, :])
    w1 = gl.load(w_rows[:, None] + (k0 + 32 + kw)[None, :])
    w2 = gl.load(w_rows[:, None] + (k0 + 64 + kw)[None, :])
    w3 = gl.load(w_rows[:, None] + (k0 + 96 + kw)[None, :])
    x0 = gl.load(x_cols[None, :] + (k0 + kx)[:, None])
    x1 = gl.load(x_cols[None, :] + (k0 + 32 + kx)[:, None])
    x2 = gl.load(x_cols[None, :] + (k0 + 64 + kx)[:, None])
    x3 = gl.load(x_cols[None, :] + (k0 + 96 + kx)[:, None])
    return w0, w1, w2, w3, x0, x1, x2, x3


@gluon.jit
def _adds4(acc, t, kb, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0: gl.constexpr, B_E8M0: gl.constexpr):
    """acc + the scaled partial products of ``_loads4``'s tiles ``t`` (K blocks kb .. kb + 3), in K order."""
    acc = _scaled_add(acc, t[0], t[4], bs_ptr, bs_rows, as_ptr, as_cols, kb, n_ok, m_ok, A_E8M0, B_E8M0)
    acc = _scaled_add(acc, t[1], t[5], bs_ptr, bs_rows, as_ptr, as_cols, kb + 1, n_ok, m_ok, A_E8M0, B_E8M0)
    acc = _scaled_add(acc, t[2], t[6], bs_ptr, bs_rows, as_ptr, as_cols, kb + 2, n_ok, m_ok, A_E8M0, B_E8M0)
    acc = _scaled_add(acc, t[3], t[7], bs_ptr, bs_rows, as_ptr, as_cols, kb + 3, n_ok, m_ok, A_E8M0, B_E8M0)
    return acc


@gluon.jit
def _step4(acc, w_rows, x_cols, k0, kw, kx, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok,
           A_E8M0: gl.constexpr, B_E8M0: gl.constexpr):  # fmt: skip
    """One step of 128: every load first (4 x 2 KB of weights in flight), then a partial product a K block of 32,
    each scaled by its block's scales."""
    t = _loads4(w_rows, x_cols, k0, kw, kx)
    return _adds4(acc, t, k0 // 32, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0, B_E8M0)


@gluon.jit
def _step8(acc, w_rows, x_cols, k0, kw, kx, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok,
           A_E8M0: gl.constexpr, B_E8M0: gl.constexpr):  # fmt: skip
    """One step of 256: the loads of both halves first (8 x 2 KB of weights in flight), then the 8 K blocks."""
    t = _loads4(w_rows, x_cols, k0, kw, kx)
    u = _loads4(w_rows, x_cols, k0 + 128, kw, kx)
    acc = _adds4(acc, t, k0 // 32, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0, B_E8M0)
    return _adds4(acc, u, k0 // 32 + 4, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0, B_E8M0)


@gluon.jit
def _fp8_rows_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, STEPS_PER_SPLIT,
    A_E8M0: gl.constexpr, B_E8M0: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    SPLIT: gl.constexpr, SUM_IN_KERNEL: gl.constexpr, BK: gl.constexpr = 128, PDL: gl.constexpr = False,
):  # fmt: skip
    """Program (pid_n, pid_m, pid_k): c[8 pid_m .. + 8, BLOCK_N pid_n .. + BLOCK_N] over K steps [pid_k * SPS,
    (pid_k + 1) * SPS) of BK (128 or 256: 4 or 8 K blocks of 32 loaded at once; SPS = STEPS_PER_SPLIT); with a K
    split, parts in the fp32 workspace [SPLIT, M, N] (``split_k.store_split_tile``).
    MXFP8: a: [M, K] e4m3, as: [M, K / 32], b: [N, K] e4m3, bs: [ceil(N / 32), K / 32]."""
    pdl_prologue(PDL)  # a triton.jit helper: Gluon calls it
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    KB = K // 32
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA))
    w_rows = b_ptr + gl.minimum(rn, N - 1).to(gl.int64) * K  # rows past N recompute the last (never stored)
    cm = pid_m * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, LB))
    x_cols = a_ptr + gl.minimum(cm, M - 1).to(gl.int64) * K
    kw = gl.arange(0, 32, layout=gl.SliceLayout(0, LA))
    kx = gl.arange(0, 32, layout=gl.SliceLayout(1, LB))
    # scale vectors in the accumulator's layout: b's per output row (its 32-row block), a's per column
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    om = pid_m * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    n_ok = on < N
    m_ok = om < M
    bs_rows = (gl.minimum(on, N - 1) // 32).to(gl.int64) * KB
    as_cols = gl.minimum(om, M - 1).to(gl.int64) * KB
    acc = gl.zeros([BLOCK_N, 8], gl.float32, MMA)
    s_lo = pid_k * STEPS_PER_SPLIT
    s_hi = gl.minimum(s_lo + STEPS_PER_SPLIT, K // BK)
    for s in range(s_lo, s_hi):
        k0 = s * BK
        if BK == 256:  # 8 x 2 KB of weights in flight before the first MMA waits on them
            acc = _step8(acc, w_rows, x_cols, k0, kw, kx, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0, B_E8M0)
        else:
            acc = _step4(acc, w_rows, x_cols, k0, kw, kx, bs_ptr, bs_rows, as_ptr, as_cols, n_ok, m_ok, A_E8M0, B_E8M0)
    tile = pid_m * gl.num_programs(0) + pid_n
    # a triton.jit helper: Gluon calls it
    store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr + tile, pid_k, om.to(gl.int64)[None, :] * N + on[:, None],
                     n_ok[:, None] & m_ok[None, :], gl.cast(M, gl.int64) * N, SPLIT, SUM_IN_KERNEL)  # fmt: skip


# Decode sizes only: above GLUON_MAX_M rows a program's 8 columns re-read and re-convert the weights per 8 rows
# and the Triton kernel's 64-row tiles win (session 30 measurements in the module docstring).
GLUON_MAX_M = 16
# Two bf16 routes for UE8M0 scales on both operands (powers of two: e4m3 x scale is exact in bf16, so they
# need no per-block accumulator rescale; fp32 scales, which need not be powers of two, stay in Triton's kernel):
# * GLUON_MAX_M < rows <= BF16_MAX_M: the in-kernel dequant Triton kernel (``triton_bf16.py``); 0: off;
# * rows >= DEQUANT_MM_FROM_M and the scale block in DEQUANT_MM_BLOCKS: dequantise both operands, one cuBLAS bf16
#   GEMM (``dequant_mm.py``, which has the measurements); None: off.
# A/B them with ``gpu_model_slice.py --set deepinfer_kernels.ops.fp8_gemm.gluon.BF16_MAX_M=512``. The first is off:
# on an H100 (session 33, cold L2) at 256 rows, where both were measured, it beat the K-split Triton kernel only
# on wq_b (70 vs 83 us); on the V4.1 slice, against the unsplit kernel, it cost +0.27 ms at batch 64 for -1.34 ms
# at 256 (the split alone: -1.22 ms at 256, nothing at 64).
BF16_MAX_M = 0
DEQUANT_MM_FROM_M: int | None = 1024
DEQUANT_MM_BLOCKS: tuple[int, ...] = (32,)
BLOCK_N = 64
NUM_WARPS = 4


# K a step (STEP_K, where K is a multiple of it, else 128) and the K split's programs an SM. A program issues a
# step's loads (STEP_K x 64 weight bytes) before its first MMA waits on them, and most programs of a decode GEMV
# run only 2-4 steps. Steps of 256 (88 registers against 62, so fewer programs resident) and 8 programs an SM were
# no faster: H100, cold GEMVs back-to-back in a graph, us at M = 1, 128 / 256 / 256 with 8 an SM: wq_b 28.6 / 27.3
# / 27.1, wo_b 26.1 / 30.6 / 28.3, w13 16.7 / 17.8 / 18.0, wq_a 9.4 / 10.3 / 10.2 (session 38,
# ``ab_split_sum_shared_fp8_gemv_h100_session38.log``). The small weights (wq_a, wkv: 7-10 us for 2.6-6.6 MB) are
# latency, not bytes in flight.
STEP_K = 128
PROGRAMS_PER_SM = 16


def _step_k(k: int) -> int:
    return STEP_K if k % STEP_K == 0 else 128


def _split(n: int, k: int) -> int:
    """K split (power of two, at most 16) from N and K only: up to ~PROGRAMS_PER_SM programs an SM, each at least
    256 columns of K (2 steps of 128, or 1 of 256)."""
    step = _step_k(k)
    return k_split(-(-n // BLOCK_N), k // step, programs_per_sm=PROGRAMS_PER_SM, min_steps=256 // step, max_split=16)


def dequant_mm_route(m: int, block: int) -> bool:
    """Whether calls of m rows with ``block`` scales (UE8M0 on both operands) go to ``dequant_mm`` (also asked by
    ``activations.py``, which then makes the bf16 activations directly)."""
    return DEQUANT_MM_FROM_M is not None and m >= DEQUANT_MM_FROM_M and block in DEQUANT_MM_BLOCKS


def fp8_gemm_nt_gluon(a, a_scale, b, b_scale, block=128, out_dtype=torch.bfloat16):
    """``fp8_gemm_nt`` for MXFP8 (block 32) at M <= GLUON_MAX_M; with UE8M0 scales on both sides the bf16 routes
    (BF16_MAX_M, DEQUANT_MM_FROM_M); other sizes, block 128 and K % 128 != 0: the Triton kernel."""
    k = a.shape[-1]
    n = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    m = a2.shape[0]
    exact_bf16 = is_ue8m0(a_scale) and is_ue8m0(b_scale)  # the bf16 routes' condition (dequant_mm.py)
    if exact_bf16 and GLUON_MAX_M < m <= BF16_MAX_M and k % BF16_BK == 0:
        return fp8_gemm_nt_triton_bf16(a, a_scale, b, b_scale, block, out_dtype)
    if exact_bf16 and dequant_mm_route(m, block) and n > 0:
        return fp8_gemm_nt_dequant_mm(a, a_scale, b, b_scale, block, out_dtype)
    if block != 32 or m > GLUON_MAX_M or k % 128 or m == 0 or n == 0:
        return fp8_gemm_nt_triton(a, a_scale, b, b_scale, block, out_dtype)
    a2 = a2.contiguous()
    sa, a_e8m0 = _scale_arg(a_scale.reshape(m, k // block))
    sb, b_e8m0 = _scale_arg(b_scale)
    split = _split(n, k)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    bk = _step_k(k)
    steps = k // bk
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, 8), split)
    out = split_output(c, split, grid[0] * grid[1])
    _fp8_rows_kernel[grid](
        a2, sa, b.contiguous(), sb, c, out.ws, out.counters, m, n, k, -(-steps // split),
        A_E8M0=a_e8m0, B_E8M0=b_e8m0, BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS, SPLIT=split,
        SUM_IN_KERNEL=out.in_kernel, BK=bk, num_warps=NUM_WARPS, **pdl_options(a2.device),
    )  # fmt: skip
    return out.finish().reshape(*lead, n)


register_backend(
    "fp8_gemm_nt", "gluon", fp8_gemm_nt_gluon, devices=("cuda",), priority=30, available=cuda_fp8_available
)

"""Gluon wgmma kernel of ``fp8_gemm_nt`` for MXFP8 (block 32) at a few dozen to a few hundred rows (decode batches
of 32-256 tokens), sm_90 only (wgmma is Hopper's).

Why not the Triton kernel (``triton.py``): with 32-wide scale blocks it issues one m64n128k32 FP8 wgmma per K block
and rescales the whole fp32 accumulator after each (a 64 x 128 multiply-add on the CUDA cores per 32 of K): session
30's V4.1 batch-256 profile spent 3.36 ms in it for ~0.5 TFLOP of dense GEMMs (~160 TFLOP/s, a fifth of the bf16
rate). Here the scales are applied to the operands instead:

* both operands are dequantised exactly to bf16 before the MMA: an e4m3 value times a power of two has 4 significant
  bits and fits bf16 (fp32 multiply, then an exact cast), so every product is exact in the fp32 sums and no
  accumulator rescale is needed; the MMA runs K = 64 a step at the bf16 rate;
* operands swapped as in the MXFP4 wgmma kernel (``mxfp4_grouped_gemm/gluon_wgmma.py``): the weights are the wide A
  operand from registers (a thread loads 8 consecutive FP8 bytes of a row, 64-bit loads, and converts them in
  place), the activation rows the B operand from shared memory (TN rows a program, converted in registers and
  stored relabelled); K is relabelled, not shuffled (``_relabel_k``);
* the next step's weights, activations and scales are loaded before the current step's conversion and wgmma
  (registers), so a step's loads overlap the previous step's work.

A program owns BLOCK_N weight rows (64 a warpgroup) and TN activation rows; grid (M tiles, N tiles, K splits) with
the M tiles fastest, so the programs sharing a weight tile run together and read it from HBM once. The K split
(``split_k``) is chosen from (M, N, K) to fill the GPU; results differ from the reference only in the order of the
fp32 sums, and the tiling depends on M (not batch-invariant). Block 128 (V4's FP8) is served too (SB: one scale
block a step).

Status (session 31): compile-checked for sm_90 (``test_wgmma_kernel_compiles_for_sm90``: one bf16 wgmma group and one
wait a step, no spills; 98 / 166 / 231 registers at TN 32 / 64 / 128), GPU tests and a probe written
(``test_gpu_wgmma_sizes``), but not yet run on a GPU: no device could be started that session. The dispatch
(``gluon.py``, WGMMA_MAX_M) keeps it off until it is measured.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon_wgmma import _relabel_k
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.ops.split_k import k_split, split_workspace, sum_splits

from .triton import _scale_arg


@gluon.jit
def _blocks(t, BK: gl.constexpr, SB: gl.constexpr):
    """[R, BK] -> [R, NB, BK / NB]: a step's scale blocks (NB of them, one when SB >= BK) as a dimension (a view)."""
    NB: gl.constexpr = BK // SB if SB < BK else 1
    return gl.reshape(t, [t.shape[0], NB, BK // NB])


@gluon.jit
def _block_offsets(rows, k0, SB: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr):
    """Scale offsets [R, NB] of row offsets ``rows`` (scale rows) and the step's NB K blocks from k0 // SB, in the
    blocks' layout of L3 (``_blocks``)."""
    kb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    return gl.convert_layout(rows, gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None] + (k0 // SB + kb)[None, :]


@gluon.jit
def _dequant(v, s, E8M0: gl.constexpr):
    """e4m3 ``v`` [R, NB, BK / NB] times its block scales ``s`` [R, NB] (UE8M0 bytes or fp32) in bf16, as [R, BK]:
    exact (module docstring)."""
    if E8M0:
        s = e8m0_to_f32(s)  # a triton.jit helper: Gluon calls it
    y = (v.to(gl.float32) * s[:, :, None]).to(gl.bfloat16)
    return gl.reshape(y, [v.shape[0], v.shape[1] * v.shape[2]])


@gluon.jit
def _load_step(w_rows, bs_rows, kw, x_rows, as_rows, kx, k0, BK: gl.constexpr, SB: gl.constexpr, X_BF16: gl.constexpr):
    """Step k0's raw operands as [R, NB, BK / NB] blocks (``_blocks``) and their [R, NB] scales: weights (R =
    BLOCK_N) and activations (R = TN), e4m3; ``bs_rows`` / ``as_rows`` point at the rows' scale rows."""
    w = _blocks(gl.load(w_rows[:, None] + (k0 + kw)[None, :]), BK, SB)
    NB: gl.constexpr = w.shape[1]
    WL3: gl.constexpr = w.type.layout
    ws = gl.load(_block_offsets(bs_rows, k0, SB, NB, WL3))
    if X_BF16:  # already dequantised: no scales
        x = gl.load(x_rows[:, None] + (k0 + kx)[None, :])
        xs = x
    else:
        x = _blocks(gl.load(x_rows[:, None] + (k0 + kx)[None, :]), BK, SB)
        XL3: gl.constexpr = x.type.layout
        xs = gl.load(_block_offsets(as_rows, k0, SB, NB, XL3))
    return w, ws, x, xs


@gluon.jit
def _fp8_wgmma_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, STEPS_PER_SPLIT,
    SB: gl.constexpr, A_E8M0: gl.constexpr, B_E8M0: gl.constexpr, X_BF16: gl.constexpr,
    TN: gl.constexpr, BLOCK_N: gl.constexpr, BK: gl.constexpr, X_SL: gl.constexpr, EPI: gl.constexpr,
    NUM_WARPS: gl.constexpr, PDL: gl.constexpr = False,
):  # fmt: skip
    """Program (pid_m, pid_n, pid_k): c[TN pid_m .. + TN, BLOCK_N pid_n .. + BLOCK_N] over K steps [pid_k * SPS,
    (pid_k + 1) * SPS) of BK (SPS = STEPS_PER_SPLIT); with a K split, c is the fp32 workspace [SPLIT, M, N].
    a: [M, K] e4m3, as: [M, K / SB], b: [N, K] e4m3, bs: [ceil(N / SB), K / SB] (SB: the scale block, 32 or 128)."""
    pdl_prologue(PDL)  # a triton.jit helper: Gluon calls it
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, TN, 16])  # fmt: skip
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    # the weights' load layout: the mma.sync A operand with k_width 8 (8 consecutive FP8 bytes a thread)
    MMA2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    LW: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=8)
    XV: gl.constexpr = 8 if X_BF16 else 16  # 16 bytes a thread
    XL: gl.constexpr = gl.BlockedLayout([1, XV], [32 // (BK // XV), BK // XV], [NUM_WARPS, 1], [1, 0])
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    KB = K // SB
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
    rn = gl.minimum(rn, N - 1).to(gl.int64)  # rows past N recompute the last (never stored)
    w_rows = b_ptr + rn * K
    bs_rows = bs_ptr + (rn // SB) * KB
    rm = gl.minimum(pid_m * TN + gl.arange(0, TN, layout=gl.SliceLayout(1, XL)), M - 1).to(gl.int64)
    x_rows = a_ptr + rm * K
    as_rows = as_ptr + rm * KB
    kw = gl.arange(0, BK, layout=gl.SliceLayout(0, LW))
    kx = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    x_s = gl.allocate_shared_memory(gl.bfloat16, [TN, BK], X_SL)
    acc = gl.zeros([BLOCK_N, TN], gl.float32, ACC)
    s_lo = pid_k * STEPS_PER_SPLIT
    s_hi = gl.minimum(s_lo + STEPS_PER_SPLIT, K // BK)  # a last split may be empty (it stores zeros)
    s_last = gl.maximum(s_hi - 1, 0)
    w_n, ws_n, x_n, xs_n = _load_step(
        w_rows, bs_rows, kw, x_rows, as_rows, kx, gl.minimum(s_lo, s_last) * BK, BK, SB, X_BF16
    )
    for s in range(s_lo, s_hi):
        w, ws, x, xs = w_n, ws_n, x_n, xs_n
        # the next step's loads go out before this step's work (the last step reloads itself: cached, unused)
        k_next = gl.minimum(s + 1, s_last) * BK
        w_n, ws_n, x_n, xs_n = _load_step(w_rows, bs_rows, kw, x_rows, as_rows, kx, k_next, BK, SB, X_BF16)
        wb = _dequant(w, ws, B_E8M0)
        if X_BF16:
            xb = x
        else:
            xb = _dequant(x, xs, A_E8M0)
        gl.thread_barrier()  # the previous step's wgmma (waited for) and every warp are past the tile
        x_s.store(_relabel_k(xb))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(gl.convert_layout(_relabel_k(wb), LA), x_s.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    out = gl.convert_layout(acc, EPI)
    on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, EPI))
    om = pid_m * TN + gl.arange(0, TN, layout=gl.SliceLayout(0, EPI))
    c_ptrs = c_ptr + pid_k.to(gl.int64) * M * N + om.to(gl.int64)[None, :] * N + on[:, None]
    gl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(on < N)[:, None] & (om < M)[None, :])


# Tiling: BLOCK_N weight rows (64 a warpgroup), BK columns a step, TN activation rows a program
# (the wgmma's N) from M: the smallest of TN_CHOICES that holds M, else the largest.
BLOCK_N = 64
BK = 64
NUM_WARPS = 4
TN_CHOICES = (32, 64, 128)
PROGRAMS_PER_SM = 2  # the K split fills the GPU up to about this many programs an SM


def wgmma_config(m: int, n: int, k: int) -> dict:
    """The tiling and K split for an [m, k] x [n, k]^T GEMM."""
    tn = next((t for t in TN_CHOICES if t >= m), TN_CHOICES[-1])
    tiles = triton.cdiv(m, tn) * triton.cdiv(n, BLOCK_N)
    split = k_split(tiles, k // BK, programs_per_sm=PROGRAMS_PER_SM, min_steps=4, max_split=16)
    return {"TN": tn, "BLOCK_N": BLOCK_N, "BK": BK, "num_warps": NUM_WARPS, "split": split}


def wgmma_meta(cfg: dict) -> dict:
    """The kernel's layout constexprs for a tiling."""
    bn, warps = cfg["BLOCK_N"], cfg["num_warps"]
    lanes_n = min(32, bn // 4)  # the epilogue: 4 consecutive output columns a thread, a warp along N first
    return dict(
        TN=cfg["TN"], BLOCK_N=bn, BK=cfg["BK"], NUM_WARPS=warps,
        X_SL=gl.NVMMASharedLayout.get_default_for([cfg["TN"], cfg["BK"]], gl.bfloat16),
        EPI=gl.BlockedLayout([4, 1], [lanes_n, 32 // lanes_n], [1, warps], [0, 1]),
    )  # fmt: skip


def fp8_gemm_nt_wgmma(a, a_scale, b, b_scale, block=32, out_dtype=torch.bfloat16, cfg: dict | None = None):
    """``fp8_gemm_nt`` (block 32 or 128), K a multiple of BK: a [..., K] e4m3 with a_scale [..., K / block], b [N, K]
    e4m3 with b_scale [ceil(N / block), K / block] (fp32 or UE8M0 scales). ``cfg`` overrides the tiling. A bf16 ``a``
    is taken as already dequantised (a_scale unused; benchmarks of the activation conversion's cost)."""
    k = a.shape[-1]
    n = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k).contiguous()
    m = a2.shape[0]
    cfg = cfg or wgmma_config(m, n, k)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c.reshape(*lead, n)
    x_bf16 = a2.dtype == torch.bfloat16
    sa, a_e8m0 = _scale_arg(a_scale.reshape(m, k // block))
    sb, b_e8m0 = _scale_arg(b_scale)
    split = cfg["split"]
    steps = k // cfg["BK"]
    ws = split_workspace(c, split)
    grid = (triton.cdiv(m, cfg["TN"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    _fp8_wgmma_kernel[grid](
        a2, sa, b.contiguous(), sb, ws, m, n, k, -(-steps // split),
        SB=block, A_E8M0=a_e8m0, B_E8M0=b_e8m0, X_BF16=x_bf16, num_warps=cfg["num_warps"],
        **wgmma_meta(cfg), **pdl_options(a2.device),
    )  # fmt: skip
    sum_splits(ws, c, split)
    return c.reshape(*lead, n)

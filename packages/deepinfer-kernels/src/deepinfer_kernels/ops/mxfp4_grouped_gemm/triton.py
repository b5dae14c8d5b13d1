"""Triton backends of the MXFP4 expert GEMMs (Hopper, sm_90: weights dequantised in registers).

Both kernels multiply on the bf16 tensor cores with fp32 accumulation through ``tl.dot_scaled`` (bf16
activations, E2M1 weights with their UE8M0 scales): Triton unpacks each weight tile (low nibble = even column)
to bf16 with byte permutes, multiplies the scale in (exact: an E2M1 value times a power of two fits bf16) and
issues the MMA with the weights as the wide operand, so a few rows cost no more MMA work than one. Products are
exact; results differ from the reference (fp32 products and sums) only in the order of the fp32 sums. Fused
epilogue: clamped SwiGLU (gate = row n, up = row n + N/2 of the expert's weights, two accumulators sharing each
x tile) and the per-row scale.

* contiguous (prefill): a program owns BLOCK_M rows of one expert and BLOCK_N output columns; the tile list
  (expert, first row, end row) is built on the device from the offsets (no host synchronisation); grid =
  ceil(R / BLOCK_M) + min(E, R) tile slots, empty slots return at once;
* gather (decode): a program owns one row (lane 0 of a BLOCK_M-row MMA tile, the other lanes masked off) and
  BLOCK_N columns: the weight bytes and their unpacking, not the padded MMA rows, bound the time.

Two UE8M0 codes are outside what the unpacking honours: scale byte 0 (2^-127, a bf16 subnormal) makes its block
zero, and 255 (NaN) makes it inf; ``mxfp4_quantize`` produces neither (its amax floor keeps the exponent
positive), and neither occurs in the released checkpoints. Under the CPU interpreter, which has no
``dot_scaled``, the kernels decode the tiles with integer ops to fp32 and take IEEE fp32 dots of the same values.

Tilings are module constants (GROUPED_CFG, GATHER_CFG), never chosen from the number of rows, and there is
no split-K: rows are independent and each element's reduction order is fixed, so both are registered
batch-invariant (the GPU tests check a token alone against the same token among 64, bitwise).

On sm_90 dispatch prefers the Gluon kernels (``gluon.py``, ``gluon_wgmma.py``; K % 256 == 0): the gathered
layout, and in the sorted one the experts with at most ``gluon.WGMMA_MAX_ROWS`` rows (``SMALL_MMA_MAX_ROWS`` in
calls under ``WGMMA_FROM_ROWS`` rows), and the larger experts of calls of ``gluon.TMA_FROM_ROWS`` rows or more
(``gluon_tma.py``); these kernels take the other experts with more rows (``grouped_rows_into``) and the other
shapes.

Measured on an H200 (session 27, ``bench_mxfp4_grouped_gemm.py --quick``, V4.1-Flash shapes, cold weights; us, %
of copy): decode gather at 1 token gate/up + down 80.7 + 41.7 (22%; the first version, fp32 products on the CUDA
cores, 149.5 + 91.2); contiguous at 64 tokens (384 rows over ~250 experts) 3010 + 1442 (25%; 9180 + 4349), at 4096
tokens 6626 + 3188 (181 TFLOP/s, 25% of bf16; 14260 + 6723). Both are bound by the unpacking on the CUDA cores (its
PTX reads the codes and scales from shared memory byte by byte), not by HBM or the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, sm90_or_newer
from deepinfer_kernels.ops.grouped_gemm.triton import expert_epilogue, expert_out
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule
from deepinfer_kernels.ops.quant.triton import e8m0_to_f32
from deepinfer_kernels.registry import register_backend


@triton.jit
def _e2m1_to_f32(code):
    """fp32 value of 4-bit E2M1 codes (int32 0..15, sign in bit 3), from the bit fields."""
    e = (code >> 1) & 3
    m = code & 1
    # e > 0: (1 + m/2) * 2^(e-1) -> fp32 exponent e + 126, top mantissa bit m; e == 0: m * 0.5 (exponent 126)
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    mag = bits.to(tl.float32, bitcast=True)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, rn, n_ok, k0, KH, KS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_K] weights of rows rn, columns k0 .. k0 + BLOCK_K (BLOCK_K a multiple of 32)."""
    rkh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rn[:, None] * KH + rkh[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    codes = tl.interleave(packed & 0xF, (packed >> 4) & 0xF)  # element 2k = low nibble of byte k
    vals = _e2m1_to_f32(codes)
    rks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sc = e8m0_to_f32(tl.load(s_ptr + rn[:, None] * KS + rks[None, :], mask=n_ok[:, None], other=127))
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return vals * sc


@triton.jit
def _mxfp4_dot(x, w_ptr, s_ptr, rn, n_ok, k0, KH, KS, acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EMULATE: tl.constexpr):  # fmt: skip
    """acc + x . W[rn, k0 : k0 + BLOCK_K]^T: x [BLOCK_M, BLOCK_K] bf16, W the MXFP4 rows rn of one expert
    (packed codes at w_ptr, KH bytes a row; UE8M0 scales at s_ptr, KS a row). EMULATE: the interpreter's path."""
    if EMULATE:
        w = _mxfp4_tile(w_ptr, s_ptr, rn, n_ok, k0, KH, KS, BLOCK_N, BLOCK_K)
        return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    rkh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(w_ptr + rn[:, None] * KH + rkh[None, :], mask=n_ok[:, None], other=0)
    rks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sc = tl.load(s_ptr + rn[:, None] * KS + rks[None, :], mask=n_ok[:, None], other=127)
    return tl.dot_scaled(x, None, "bf16", tl.trans(packed), sc, "e2m1", acc, fast_math=True)


@triton.jit
def _rows_gemm(
    x_ptr, w_ptr, s_ptr, e, in_rows, m_ok, rn, n_ok, N_OUT, K,
    FUSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """(gate or plain, up) fp32 [BLOCK_M, BLOCK_N] accumulators of input rows ``in_rows`` against expert ``e``
    (int64) of the stacks at w_ptr / s_ptr; K walked in order in BLOCK_K steps."""
    KH = K // 2
    KS = K // 32
    n_rows = 2 * N_OUT if FUSE else N_OUT
    we_ptr = w_ptr + e * n_rows * KH
    se_ptr = s_ptr + e * n_rows * KS
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + in_rows[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        x = x.to(tl.bfloat16)  # the operand is rounded to bf16 (fp16 / fp32 inputs)
        acc_g = _mxfp4_dot(x, we_ptr, se_ptr, rn, n_ok, k0, KH, KS, acc_g, BLOCK_N, BLOCK_K, EMULATE)
        if FUSE:
            acc_u = _mxfp4_dot(x, we_ptr, se_ptr, rn + N_OUT, n_ok, k0, KH, KS, acc_u, BLOCK_N, BLOCK_K, EMULATE)
    return acc_g, acc_u


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, index_ptr,
    N_OUT, K, limit,
    FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_RS: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (pid_n, tile): output columns of one BLOCK_M-row tile of the sorted rows; row r reads x[r] (HAS_INDEX:
    x[index[r]])."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        rm = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = rm < r1
        in_rows = rm
        if HAS_INDEX:
            in_rows = tl.load(index_ptr + rm, mask=m_ok, other=0).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N_OUT
        acc_g, acc_u = _rows_gemm(
            x_ptr, w_ptr, s_ptr, e.to(tl.int64), in_rows, m_ok, rn, n_ok, N_OUT, K, FUSE, BLOCK_M, BLOCK_N, BLOCK_K,
            EMULATE,
        )  # fmt: skip
        rs = 1.0
        if HAS_RS:
            rs = tl.load(rs_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)
        out_ptrs = out_ptr + rm[:, None] * N_OUT + rn[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gather_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, expert_ptr, index_ptr,
    N_OUT, K, limit, RPI,
    FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_RS: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    p = tl.program_id(0).to(tl.int64)  # axis 0 walks the rows (no 65535 limit on their number)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + p).to(tl.int64)
    src = p // RPI  # RPI: rows of y per row of x without an index
    if HAS_INDEX:
        src = tl.load(index_ptr + p).to(tl.int64)
    lane = tl.arange(0, BLOCK_M)
    m_ok = lane == 0  # row p in lane 0; the other lanes read nothing and store nothing
    in_rows = tl.where(m_ok, src, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N_OUT
    acc_g, acc_u = _rows_gemm(
        x_ptr, w_ptr, s_ptr, e, in_rows, m_ok, rn, n_ok, N_OUT, K, FUSE, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE
    )
    rs = 1.0
    if HAS_RS:
        rs = tl.load(rs_ptr + p + lane * 0, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)
    out_ptrs = out_ptr + (p + lane)[:, None] * N_OUT + rn[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Tilings, fixed whatever the row count (the batch-invariant property). BLOCK_K must divide K (it falls back to
# 128, then 32). Session 27's sweep (H200, cold weights, V4 and V4.1 shapes at 1 / 8 tokens; 64 / 4096 for the
# contiguous layout): gather 64 columns, 4 warps, 3 stages; contiguous 64-row tiles, 4 warps. The benchmark's --sweep
# mutates these dicts.
GROUPED_CFG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_N_SWIGLU": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
GATHER_CFG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_N_SWIGLU": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}


def _block_k(k: int, want: int) -> int:
    for bk in (want, 128, 32):
        if k % bk == 0:
            return bk
    raise ValueError(f"K = {k} is not a multiple of 32")


def _prep(x, w, w_scale, fuse_swiglu, row_scale):
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    xs = x.contiguous()
    wb = w.contiguous().view(torch.uint8)
    sb = w_scale.contiguous().view(torch.uint8)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    return n_out, xs, wb, sb, rs


def mxfp4_grouped_gemm_triton(
    x, w, w_scale, expert_offsets, *, row_index=None, fuse_swiglu=False, swiglu_limit=None, row_scale=None,
    out_dtype=torch.bfloat16,
):  # fmt: skip
    """Contiguous layout (see module docstring)."""
    out = expert_out(x.shape[0] if row_index is None else row_index.shape[0], w, fuse_swiglu, out_dtype, x.device)
    return grouped_rows_into(out, x, w, w_scale, expert_offsets, row_index=row_index, fuse_swiglu=fuse_swiglu,
                             swiglu_limit=swiglu_limit, row_scale=row_scale)  # fmt: skip


def grouped_tile_spec(min_rows: int = 0, block_m: int | None = None) -> tuple[int, int, None]:
    """The (BLOCK_M, min_rows, max_rows) of ``grouped_rows_into``'s tile list (``expert_tile_schedules``)."""
    return (block_m or GROUPED_CFG["BLOCK_M"], min_rows, None)


def grouped_rows_into(
    out, x, w, w_scale, expert_offsets, *, row_index=None, min_rows=0, block_m=None, fuse_swiglu=False,
    swiglu_limit=None, row_scale=None, tiles=None,
):  # fmt: skip
    """The contiguous layout's rows of the experts that have at least ``min_rows`` rows, written into ``out`` ([R, N]
    or [R, N/2]; other rows untouched): the Gluon backend leaves those experts to these tiles of ``block_m`` rows
    (None: GROUPED_CFG's). Row r reads x[r], or x[row_index[r]] ([R]). ``tiles``: the tile list of
    ``grouped_tile_spec(min_rows, block_m)``, when the caller built it already."""
    n_out, xs, wb, sb, rs = _prep(x, w, w_scale, fuse_swiglu, row_scale)
    rows, k = out.shape[0], x.shape[1]
    if rows == 0 or n_out == 0:
        return out
    cfg = GROUPED_CFG
    spec = grouped_tile_spec(min_rows, block_m)
    bm, bk = spec[0], _block_k(k, cfg["BLOCK_K"])
    bn = cfg["BLOCK_N_SWIGLU"] if fuse_swiglu else cfg["BLOCK_N"]
    tile_e, tile_r0, tile_r1, slots = tiles or expert_tile_schedule(expert_offsets, rows, *spec)
    grid = (triton.cdiv(n_out, bn), slots)
    index = row_index.contiguous() if row_index is not None else tile_e  # dummy pointer when absent
    _grouped_kernel[grid](
        xs, wb, sb, out, rs, tile_e, tile_r0, tile_r1, index, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=row_index is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EMULATE=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(xs.device),
    )  # fmt: skip
    return out


def mxfp4_grouped_gemm_gather_triton(
    x,
    w,
    w_scale,
    row_expert,
    *,
    row_index=None,
    rows_per_input=1,
    fuse_swiglu=False,
    swiglu_limit=None,
    row_scale=None,
    out_dtype=torch.bfloat16,
):
    """Gathered layout (see module docstring)."""
    n_out, xs, wb, sb, rs = _prep(x, w, w_scale, fuse_swiglu, row_scale)
    p = row_expert.shape[0]
    k = x.shape[1]
    out = torch.empty(p, n_out, dtype=out_dtype, device=x.device)
    if p == 0 or n_out == 0:
        return out
    cfg = GATHER_CFG
    bn = cfg["BLOCK_N_SWIGLU"] if fuse_swiglu else cfg["BLOCK_N"]
    bk = _block_k(k, cfg["BLOCK_K"])
    idx = row_index.contiguous() if row_index is not None else row_expert
    grid = (p, triton.cdiv(n_out, bn))
    _gather_kernel[grid](
        xs, wb, sb, out, rs, row_expert.contiguous(), idx, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0, rows_per_input,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=row_index is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, EMULATE=interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(xs.device),
    )  # fmt: skip
    return out


for _op, _fn in (
    ("mxfp4_grouped_gemm", mxfp4_grouped_gemm_triton),
    ("mxfp4_grouped_gemm_gather", mxfp4_grouped_gemm_gather_triton),
):
    register_backend(_op, "triton", _fn, devices=("cuda",), priority=20, available=sm90_or_newer, batch_invariant=True)

"""Triton backends of the MXFP4 expert GEMMs (Hopper, sm_90: weights dequantised in registers).

Weight tiles are unpacked from bytes (low nibble = even column), decoded from the E2M1 bit fields to fp32
(exact), multiplied by the UE8M0 scale (exact) and rounded to bf16 (exact: 2 mantissa bits), then fed to
the bf16 tensor cores with fp32 accumulation. Fused epilogue: clamped SwiGLU (gate = row n, up = row
n + N/2 of the expert's weights, two accumulators sharing each x tile) and the per-row scale.

* contiguous (prefill): a program owns BLOCK_M rows of one expert and BLOCK_N output columns; the tile list
  (expert, first row, end row) is built on the device from the offsets (no host synchronisation); grid =
  ceil(R / BLOCK_M) + E tile slots, empty slots return at once;
* gather (decode): a program owns one row and BLOCK_N columns (a GEMV on the CUDA cores: at decode sizes
  the weight bytes, not the MMA, bound the time).

Tilings are module constants (GROUPED_CFG, GATHER_CFG), never chosen from the number of rows, and there is
no split-K: rows are independent and each element's reduction order is fixed, so both are registered
batch-invariant (the GPU tests check a token alone against the same token among 64, bitwise).

Measured on an H200 (2026-11-29, first version, untuned): gather gate/up + down at 1 token ~150 + 90 us
(about 0.5 TB/s of weights: bound by the in-register dequantisation on the CUDA cores, not by HBM);
contiguous at 4096 tokens ~14 ms + 7 ms (about 80 TFLOP/s). ``bench_mxfp4_grouped_gemm.py --sweep`` times
other tilings.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule
from deepinfer_kernels.registry import register_backend


@triton.jit
def _e8m0_to_f32(e):
    """fp32 2^(e-127) of UE8M0 bytes; 0 -> 2^-127, 255 -> NaN."""
    ei = e.to(tl.int32) & 0xFF
    bits = tl.where(ei == 0, 0x400000, ei << 23)
    bits = tl.where(ei == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


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
    sc = _e8m0_to_f32(tl.load(s_ptr + rn[:, None] * KS + rks[None, :], mask=n_ok[:, None], other=127))
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return vals * sc


@triton.jit
def _dot_bf16(x, w, acc, F32_DOT: tl.constexpr):
    """acc + x . w^T with bf16-exact operands. F32_DOT (the CPU interpreter only: Triton 3.6's interpreter
    reads bf16 dot operands as raw integers) multiplies the same values as fp32 in IEEE mode instead."""
    if F32_DOT:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _epilogue(acc_g, acc_u, rs, FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, limit, HAS_RS: tl.constexpr):
    if FUSE:
        g = acc_g
        u = acc_u
        if HAS_LIMIT:
            g = tl.minimum(g, limit)  # one-sided on the gate
            u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        y = acc_g
    if HAS_RS:
        y = y * rs
    return y


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
    N_OUT, K, limit,
    FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_RS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        rm = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_ok = rm < r1
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N_OUT
        KH = K // 2
        KS = K // 32
        n_rows = 2 * N_OUT if FUSE else N_OUT
        we_ptr = w_ptr + e.to(tl.int64) * n_rows * KH
        se_ptr = s_ptr + e.to(tl.int64) * n_rows * KS
        rk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
            x = x.to(tl.bfloat16)
            wg = _mxfp4_tile(we_ptr, se_ptr, rn, n_ok, k0, KH, KS, BLOCK_N, BLOCK_K).to(tl.bfloat16)
            acc_g = _dot_bf16(x, wg, acc_g, F32_DOT)
            if FUSE:
                wu = _mxfp4_tile(we_ptr, se_ptr, rn + N_OUT, n_ok, k0, KH, KS, BLOCK_N, BLOCK_K).to(tl.bfloat16)
                acc_u = _dot_bf16(x, wu, acc_u, F32_DOT)
        rs = 1.0
        if HAS_RS:
            rs = tl.load(rs_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = _epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)
        out_ptrs = out_ptr + rm[:, None] * N_OUT + rn[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gather_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, expert_ptr, index_ptr,
    N_OUT, K, limit,
    FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_RS: tl.constexpr, HAS_INDEX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    p = tl.program_id(1).to(tl.int64)
    e = tl.load(expert_ptr + p).to(tl.int64)
    src = p
    if HAS_INDEX:
        src = tl.load(index_ptr + p).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N_OUT
    KH = K // 2
    KS = K // 32
    n_rows = 2 * N_OUT if FUSE else N_OUT
    we_ptr = w_ptr + e * n_rows * KH
    se_ptr = s_ptr + e * n_rows * KS
    rk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # the operand is rounded to bf16 as in the tensor-core path; products and sums in fp32
        x = tl.load(x_ptr + src * K + k0 + rk).to(tl.bfloat16).to(tl.float32)
        wg = _mxfp4_tile(we_ptr, se_ptr, rn, n_ok, k0, KH, KS, BLOCK_N, BLOCK_K)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        if FUSE:
            wu = _mxfp4_tile(we_ptr, se_ptr, rn + N_OUT, n_ok, k0, KH, KS, BLOCK_N, BLOCK_K)
            acc_u += tl.sum(wu * x[None, :], axis=1)
    rs = 1.0
    if HAS_RS:
        rs = tl.load(rs_ptr + p).to(tl.float32)
    y = _epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)
    tl.store(out_ptr + p * N_OUT + rn, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Tilings, fixed whatever the row count (the batch-invariant property). Grouped: 128 rows per program halve
# the dequantisation work per MMA flop against 64 (prefill is bound by the in-register dequantisation, not the
# tensor cores). BLOCK_K must divide K (it falls back to 32). The benchmark's --sweep mutates these dicts.
GROUPED_CFG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_N_SWIGLU": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
GATHER_CFG = {"BLOCK_N": 64, "BLOCK_N_SWIGLU": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


def _block_k(k: int, want: int) -> int:
    return want if k % want == 0 else 32


def _prep(x, w, w_scale, fuse_swiglu, row_scale):
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    xs = x.contiguous()
    wb = w.contiguous().view(torch.uint8)
    sb = w_scale.contiguous().view(torch.uint8)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    return n_out, xs, wb, sb, rs


def mxfp4_grouped_gemm_triton(
    x, w, w_scale, expert_offsets, *, fuse_swiglu=False, swiglu_limit=None, row_scale=None, out_dtype=torch.bfloat16
):
    """Contiguous layout (see module docstring)."""
    n_out, xs, wb, sb, rs = _prep(x, w, w_scale, fuse_swiglu, row_scale)
    rows, k = x.shape
    out = torch.empty(rows, n_out, dtype=out_dtype, device=x.device)
    if rows == 0 or n_out == 0:
        return out
    cfg = GROUPED_CFG
    bm, bk = cfg["BLOCK_M"], _block_k(k, cfg["BLOCK_K"])
    bn = cfg["BLOCK_N_SWIGLU"] if fuse_swiglu else cfg["BLOCK_N"]
    tile_e, tile_r0, tile_r1, slots = expert_tile_schedule(expert_offsets, rows, bm)
    grid = (triton.cdiv(n_out, bn), slots)
    _grouped_kernel[grid](
        xs, wb, sb, out, rs, tile_e, tile_r0, tile_r1, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, F32_DOT=_interpreting(),
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
    grid = (triton.cdiv(n_out, bn), p)
    _gather_kernel[grid](
        xs, wb, sb, out, rs, row_expert.contiguous(), idx, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=row_index is not None, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(xs.device),
    )  # fmt: skip
    return out


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


for _op, _fn in (
    ("mxfp4_grouped_gemm", mxfp4_grouped_gemm_triton),
    ("mxfp4_grouped_gemm_gather", mxfp4_grouped_gemm_gather_triton),
):
    register_backend(
        _op, "triton", _fn, devices=("cuda",), priority=20, available=_cuda_available, batch_invariant=True
    )

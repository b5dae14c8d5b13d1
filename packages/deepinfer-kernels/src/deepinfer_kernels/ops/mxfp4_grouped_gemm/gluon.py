"""Gluon backend of the gathered (decode) MXFP4 expert GEMM: weights dequantised in registers straight into the
``mma.sync`` operand layout (registered for sm_90+, where it was tuned and tested: the H200).

Why not ``tl.dot_scaled`` (the Triton backend): on Hopper it unpacks each weight tile through shared memory with
byte-wise reads, which bounds a decode GEMV at ~22% of the copy rate. Here nothing goes through shared memory:

* a warp owns 16 weight rows (``m16n8k16`` A operand, ``k_width`` 8: a thread holds 8 consecutive packed bytes of
  a row, one 64-bit load), the token is the B operand (its 8 columns all hold the same row of x: a single token
  per program, the other 7 columns are free work on the tensor cores);
* the bytes are split by nibble instead of interleaved: the low nibbles (even columns) multiply x[0::2] and the
  high nibbles (odd columns) x[1::2], two MMAs per tile, so no register shuffle is needed;
* E2M1 -> bf16 by bit moves (inline PTX, 4 bytes -> 8 values in 14 integer ops): sign to bit 15, the 3 magnitude
  bits to bits 6..8 make the bf16 2^-126 * value (0.5 is a bf16 subnormal), then two exact bf16 multiplies, by
  2^126 and by the block's scale 2^(s-127).

Products are exact (an E2M1 value times a power of two fits bf16), sums are fp32 in the tensor cores: results
differ from the reference only in the order of the fp32 sums. Scale bytes 0 and 255 are outside what the
multiply honours (the block becomes zero / inf instead of 2^-127 / NaN), as in the Triton backend; neither occurs
in the checkpoints or from ``mxfp4_quantize``. The tiling is fixed (never chosen from the row count) and each
program owns one row, so rows are independent bitwise (registered batch-invariant; the GPU tests check it).

Shapes it serves: K a multiple of 256 (V4 / V4.1-Flash: 4096, 2048, 5120, 2304); others go to the Triton kernel.
Measured on an H200 (session 28, ``bench_mxfp4_gather_cold.py``: CUDA graphs after a 256 MB copy; us, Triton ->
this, % of copy): V4.1 one token gate/up 74.2 -> 65.8 (26.9%), down 36.3 -> 20.3 (43.7%); four tokens 263.3 ->
232.7, 103.6 -> 66.8 (48.6%); V4 one token 58.8 -> 53.9, 19.7 -> 16.1. Still bound by instruction issue (~3.5
instructions a weight: the unpack, the two multiplies, x's 32-bit loads) and by too few bytes in flight at one token
(no cross-step prefetch: carried uint8 tiles cost a byte repack per step in registers); the next steps are in
benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from deepinfer_kernels.ops.grouped_gemm.triton import expert_epilogue
from deepinfer_kernels.registry import register_backend

from .triton import mxfp4_grouped_gemm_gather_triton

# $4: 4 packed bytes; $5, $6: 4 bf16 scales (two per register) -> $0 $1: the 4 low nibbles, $2 $3: the 4 high
# nibbles, as bf16 pairs. t = [0, b0, 0, b1] puts a low nibble's magnitude 2 bits above bits 6..8 and its sign 4
# below bit 15; a high nibble's magnitude 6 above, its sign already at 15 (masked: bit 8 of t is a low-nibble bit).
_UNPACK_SCALED = gl.constexpr("""{
.reg .b32 t, a, b;
prmt.b32 t, $4, 0, 0x1404;
shr.b32 a, t, 2; shl.b32 b, t, 4; lop3.b32 $0, a, b, 0x81C081C0, 0xA8;
shr.b32 a, t, 6; and.b32 b, t, 0x80008000; lop3.b32 $2, a, b, 0x01C001C0, 0xEC;
prmt.b32 t, $4, 0, 0x3424;
shr.b32 a, t, 2; shl.b32 b, t, 4; lop3.b32 $1, a, b, 0x81C081C0, 0xA8;
shr.b32 a, t, 6; and.b32 b, t, 0x80008000; lop3.b32 $3, a, b, 0x01C001C0, 0xEC;
mov.b32 a, 0x7E807E80;
mul.rn.bf16x2 $0, $0, a; mul.rn.bf16x2 $1, $1, a; mul.rn.bf16x2 $2, $2, a; mul.rn.bf16x2 $3, $3, a;
mul.rn.bf16x2 $0, $0, $5; mul.rn.bf16x2 $1, $1, $6; mul.rn.bf16x2 $2, $2, $5; mul.rn.bf16x2 $3, $3, $6;
}""")


@gluon.jit
def _unpack_scaled(packed, scale):
    """(low nibbles, high nibbles) of uint8 ``packed`` as bf16 E2M1 values times the bf16 ``scale`` (same shape)."""
    return gl.inline_asm_elementwise(
        _UNPACK_SCALED, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
    )


@gluon.constexpr_function
def _x_layout(bkh, num_warps):
    """[BKH, 8, 2] (byte column, MMA column, nibble) layout whose two halves are the B operand layout (k_width 8)."""
    regs = [[0, 0, 1], [1, 0, 0], [2, 0, 0], [4, 0, 0]] + [[32 << i, 0, 0] for i in range((bkh // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[8, 0, 0], [16, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 0, 0]] * (num_warps.bit_length() - 1),
        block_bases=[],
        shape=[bkh, 8, 2],
    )


@gluon.jit
def _rows_dot(w_rows, s_rows, k0, kh, KH, KS, x_even, x_odd, acc):
    """acc + (rows of one expert, packed byte columns k0 .. k0 + BKH) . x: w_rows / s_rows the row pointers."""
    packed = gl.load(w_rows[:, None] + (k0 + kh)[None, :])
    s = gl.load(s_rows[:, None] + ((k0 + kh) // 16)[None, :])  # a scale per 16 bytes (equal loads are merged)
    scale = ((s.to(gl.int32) & 0xFF) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)  # 2^(s-127)
    lo, hi = _unpack_scaled(packed, scale)
    acc = mma_v2(lo, x_even, acc)
    return mma_v2(hi, x_odd, acc)


@gluon.jit
def _gather_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, expert_ptr, index_ptr, N_OUT, K, limit,
    FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr, HAS_INDEX: gl.constexpr,
    BLOCK_N: gl.constexpr, BKH: gl.constexpr, NUM_WARPS: gl.constexpr,
):  # fmt: skip
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    LX: gl.constexpr = _x_layout(BKH, NUM_WARPS)
    p = gl.program_id(0).to(gl.int64)
    pid_n = gl.program_id(1)
    e = gl.load(expert_ptr + p).to(gl.int64)
    src = p
    if HAS_INDEX:
        src = gl.load(index_ptr + p).to(gl.int64)
    KH = K // 2
    KS = K // 32
    n_rows = 2 * N_OUT if FUSE else N_OUT
    # rows past N_OUT recompute the last row (never stored) instead of masking every load
    rn = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA)), N_OUT - 1).to(gl.int64)
    w_gate = w_ptr + e * n_rows * KH + rn * KH
    s_gate = s_ptr + e * n_rows * KS + rn * KS
    kh = gl.arange(0, BKH, layout=gl.SliceLayout(0, LA))
    kx = gl.arange(0, BKH, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    nx = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    px = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
    x_tile = x_ptr + src * K + 2 * kx[:, None, None] + px[None, None, :] + 0 * nx[None, :, None]
    acc_g = gl.zeros([BLOCK_N, 8], gl.float32, MMA)
    acc_u = gl.zeros([BLOCK_N, 8], gl.float32, MMA)
    for k0 in range(0, KH, BKH):
        x_even, x_odd = gl.load(x_tile + 2 * k0).split()
        x_even = gl.convert_layout(x_even, LB, assert_trivial=True)
        x_odd = gl.convert_layout(x_odd, LB, assert_trivial=True)
        acc_g = _rows_dot(w_gate, s_gate, k0, kh, KH, KS, x_even, x_odd, acc_g)
        if FUSE:
            acc_u = _rows_dot(w_gate + N_OUT * KH, s_gate + N_OUT * KS, k0, kh, KH, KS, x_even, x_odd, acc_u)
    rs = 1.0
    if HAS_RS:
        rs = gl.load(rs_ptr + p).to(gl.float32)
    y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)  # a triton.jit helper: Gluon calls it
    ro = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    out_ptrs = out_ptr + p * N_OUT + ro[:, None] + no[None, :]
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(ro < N_OUT)[:, None] & (no == 0)[None, :])


# Fixed tiling (batch-invariant). Session 28 (H200, V4 and V4.1 shapes, one and eight tokens): 64 rows a program
# (16 a warp), 128 packed bytes (256 columns) a step; 128 rows or 256-byte steps were slower at one token.
GATHER_CFG = {"BLOCK_N": 64, "BKH": 128, "num_warps": 4}


def mxfp4_grouped_gemm_gather_gluon(
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
    """Gathered layout (see module docstring); K not a multiple of 2 * BKH goes to the Triton kernel."""
    cfg = GATHER_CFG
    k = x.shape[1]
    if k % (2 * cfg["BKH"]):
        return mxfp4_grouped_gemm_gather_triton(
            x, w, w_scale, row_expert, row_index=row_index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit,
            row_scale=row_scale, out_dtype=out_dtype,
        )  # fmt: skip
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    p = row_expert.shape[0]
    out = torch.empty(p, n_out, dtype=out_dtype, device=x.device)
    if p == 0 or n_out == 0:
        return out
    xs = x.to(torch.bfloat16).contiguous()  # the MMA operand is bf16 (fp16 / fp32 inputs are rounded)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    idx = row_index.contiguous() if row_index is not None else row_expert
    grid = (p, triton.cdiv(n_out, cfg["BLOCK_N"]))
    _gather_kernel[grid](
        xs, w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8), out, rs,
        row_expert.contiguous(), idx, n_out, k, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=row_index is not None, BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"], NUM_WARPS=cfg["num_warps"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


register_backend(
    "mxfp4_grouped_gemm_gather",
    "gluon",
    mxfp4_grouped_gemm_gather_gluon,
    devices=("cuda",),
    priority=30,
    available=_cuda_available,
    batch_invariant=True,
)

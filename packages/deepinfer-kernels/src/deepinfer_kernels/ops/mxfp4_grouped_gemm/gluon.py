"""Gluon backends of the MXFP4 expert GEMMs for decode: weights dequantised in registers straight into the
``mma.sync`` operand layout (registered for sm_90+, where they were tuned and tested: the H200).

Why not ``tl.dot_scaled`` (the Triton backend): on Hopper it unpacks each weight tile through shared memory with
byte-wise reads, which bounds a decode GEMM at ~22-25% of the copy rate. Here nothing goes through shared memory
in the main loop:

* a warp owns 16 weight rows (``m16n8k16`` A operand, ``k_width`` 8: a thread holds 8 consecutive packed bytes of
  a row, one 64-bit load); up to 8 rows of x are the B operand's 8 columns: one token repeated (gathered layout,
  a program a (token, expert) row) or 8 rows of one expert (sorted layout, ``expert_tile_schedule`` tiles of 8);
* the fused gate/up tile interleaves gate and up rows by 8 within each warp's 16, so an MMA thread holds the gate
  and the up sum of the same output column (SwiGLU without an exchange) and a program keeps one accumulator and
  one weight tile, as the down GEMM (two of each took 168-182 registers and halved the programs an SM holds);
* the bytes are split by nibble instead of interleaved: the low nibbles (even columns) multiply x[0::2] and the
  high nibbles (odd columns) x[1::2], two MMAs per tile, so no register shuffle is needed;
* E2M1 -> bf16 by bit moves (inline PTX, 4 bytes -> 8 values in 14 integer ops): sign to bit 15, the 3 magnitude
  bits to bits 6..8 make the bf16 2^-126 * value (0.5 is a bf16 subnormal), then two exact bf16 multiplies, by
  2^126 and by the block's scale 2^(s-127).

Products are exact (an E2M1 value times a power of two fits bf16), sums are fp32 in the tensor cores: results
differ from the reference only in the order of the fp32 sums. Scale bytes 0 and 255 are outside what the
multiply honours (the block becomes zero / inf instead of 2^-127 / NaN), as in the Triton backend; neither occurs
in the checkpoints or from ``mxfp4_quantize``. The tiling is fixed and an output column depends only on its own x
row, so rows are bitwise independent of the others. The gathered backend is registered batch-invariant; the
sorted one is not (an expert's row count chooses between this kernel and the Triton one, whose sums differ in
order).

Shapes served: K a multiple of 256 (V4 / V4.1-Flash: 4096, 2048, 5120, 2304); others go to the Triton kernels.
Measured on an H200 (session 29, ``bench_mxfp4_gather_cold.py``: CUDA graphs after a 256 MB copy, uniform random
routing; us, Triton -> this, % of copy): V4.1 gathered one token gate/up 74.8 -> 40.4 (43.9%), down 36.3 -> 20.2
(43.8%); sorted 8 tokens 608 -> 239 (56.9%) and 270 -> 125 (54.3%), 64 tokens 2902 -> 1208 (59.4%) and 1383 ->
611 (58.6%). Still bound by instruction issue (~3.3 SASS instructions a weight, nearly all the unpack and the
two multiplies; x comes in 128-bit loads) and at one token by too few bytes in flight (no cross-step prefetch:
carried uint8 tiles cost a byte repack per step in registers); next steps in benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from deepinfer_kernels.ops.grouped_gemm.triton import expert_epilogue, expert_out
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule
from deepinfer_kernels.registry import register_backend

from .triton import _cuda_available, grouped_rows_into, mxfp4_grouped_gemm_gather_triton, mxfp4_grouped_gemm_triton

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
    """[2 BKH, 8] (x column, MMA column) layout of a thread's 16 consecutive x elements a column: reshaped to [BKH, 2,
    8] and permuted to [BKH, 8, 2], its two nibble halves are the B operand layout (k_width 8)."""
    regs = [[1, 0], [2, 0], [4, 0], [8, 0]] + [[64 << i, 0] for i in range((bkh // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0]] * (num_warps.bit_length() - 1),
        block_bases=[],
        shape=[2 * bkh, 8],
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
def _store_rows(acc_g, acc_u, L: gl.constexpr, out_ptr, rs_ptr, n0, N_OUT, limit, p, r0, r1,
                SORTED: gl.constexpr, FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr):  # fmt: skip
    """Epilogue of [BN, 8] accumulators in layout L: output columns n0 .. n0 + BN of the tile's rows (SORTED:
    rows r0 + c for c < r1 - r0; else row p, MMA column 0)."""
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, L))
    if SORTED:
        out_rows = r0 + no
        col_ok = out_rows < r1
    else:
        out_rows = p + 0 * no
        col_ok = no == 0
    rs = 1.0
    if HAS_RS:
        rs = gl.load(rs_ptr + out_rows, mask=col_ok, other=0.0).to(gl.float32)[None, :]
    y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)  # a triton.jit helper: Gluon calls it
    ro = n0 + gl.arange(0, acc_g.shape[0], layout=gl.SliceLayout(1, L))
    out_ptrs = out_ptr + out_rows[None, :] * N_OUT + ro[:, None]
    gl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(ro < N_OUT)[:, None] & col_ok[None, :])


@gluon.jit
def _expert_rows_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, expert_ptr, index_ptr, r0_ptr, r1_ptr, N_OUT, K, limit,
    SORTED: gl.constexpr, FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr,
    HAS_INDEX: gl.constexpr, BLOCK_N: gl.constexpr, BKH: gl.constexpr, NUM_WARPS: gl.constexpr,
):  # fmt: skip
    """Program (p, pid_n): BLOCK_N weight rows (FUSE: BLOCK_N / 2 gate and as many up rows) of one expert
    against up to 8 rows of x, the MMA's 8 B columns. SORTED: p is a tile slot (``expert_tile_schedule``:
    expert_ptr / r0_ptr / r1_ptr give its expert (-1: empty) and rows [r0, r1), at most 8); else p is a gathered
    row (expert_ptr[p], input row index_ptr[p] with HAS_INDEX) in all 8 columns, column 0 stored."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
    LX: gl.constexpr = _x_layout(BKH, NUM_WARPS)
    p = gl.program_id(0).to(gl.int64)
    pid_n = gl.program_id(1)
    e = gl.load(expert_ptr + p).to(gl.int64)
    if e >= 0:
        nx = gl.arange(0, 8, layout=gl.SliceLayout(0, LX))
        r0 = p
        r1 = p
        if SORTED:
            r0 = gl.load(r0_ptr + p).to(gl.int64)
            r1 = gl.load(r1_ptr + p).to(gl.int64)
            x_rows = gl.minimum(r0 + nx, r1 - 1)  # columns past the tile's rows repeat its last row (not stored)
        else:
            src = p
            if HAS_INDEX:
                src = gl.load(index_ptr + p).to(gl.int64)
            x_rows = src + 0 * nx
        KH = K // 2
        KS = K // 32
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA))
        if FUSE:
            # tile row j = 16 w + 8 h + g holds output column 8 w + g of the gate (h = 0) or up (h = 1) rows: an
            # mma.sync thread owns rows g and g + 8 of its warp's 16, so a column's gate and up sums meet in one
            # thread's registers, and a program holds one accumulator and one weight tile (as the down GEMM)
            n0 = pid_n * (BLOCK_N // 2)
            col = gl.minimum(n0 + 8 * (j // 16) + j % 8, N_OUT - 1).to(gl.int64)
            rn = col + ((j // 8) % 2).to(gl.int64) * N_OUT
        else:
            n0 = pid_n * BLOCK_N
            rn = gl.minimum(n0 + j, N_OUT - 1).to(gl.int64)  # rows past N_OUT recompute the last (never stored)
        n_rows = 2 * N_OUT if FUSE else N_OUT
        w_rows = w_ptr + e * n_rows * KH + rn * KH
        s_rows = s_ptr + e * n_rows * KS + rn * KS
        kh = gl.arange(0, BKH, layout=gl.SliceLayout(0, LA))
        kx = gl.arange(0, 2 * BKH, layout=gl.SliceLayout(1, LX))
        x_tile = x_ptr + x_rows[None, :] * K + kx[:, None]
        acc = gl.zeros([BLOCK_N, 8], gl.float32, MMA)
        for k0 in range(0, KH, BKH):
            x_pairs = gl.permute(gl.reshape(gl.load(x_tile + 2 * k0), [BKH, 2, 8]), [0, 2, 1])
            x_even, x_odd = x_pairs.split()
            x_even = gl.convert_layout(x_even, LB, assert_trivial=True)
            x_odd = gl.convert_layout(x_odd, LB, assert_trivial=True)
            acc = _rows_dot(w_rows, s_rows, k0, kh, KH, KS, x_even, x_odd, acc)
        if FUSE:
            EPI: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [NUM_WARPS, 1], [1, 0])
            g, u = gl.permute(gl.reshape(acc, [BLOCK_N // 16, 2, 8, 8]), [0, 2, 3, 1]).split()
            acc_g = gl.convert_layout(gl.reshape(g, [BLOCK_N // 2, 8]), EPI)
            acc_u = gl.convert_layout(gl.reshape(u, [BLOCK_N // 2, 8]), EPI)
            _store_rows(acc_g, acc_u, EPI, out_ptr, rs_ptr, n0, N_OUT, limit, p, r0, r1, SORTED, FUSE, HAS_LIMIT,
                        HAS_RS)  # fmt: skip
        else:
            _store_rows(acc, acc, MMA, out_ptr, rs_ptr, n0, N_OUT, limit, p, r0, r1, SORTED, FUSE, HAS_LIMIT,
                        HAS_RS)  # fmt: skip


# Fixed tiling (batch-invariant). Session 28 (H200, V4 and V4.1 shapes, one and eight tokens): 64 weight rows a
# program (16 a warp; fused gate/up: 32 output columns), 128 packed bytes (256 columns) a step; 128 rows or 256-byte
# steps were slower at one token, 64-byte steps no faster in session 29 (``bench_mxfp4_gather_cold.py --set``).
GATHER_CFG = {"BLOCK_N": 64, "BKH": 128, "num_warps": 4}
SORTED_CFG = {"BLOCK_N": 64, "BKH": 128, "num_warps": 4}
TILE_ROWS = 8  # rows a sorted-layout tile (the MMA's N)
# Sorted layout: experts with at most MAX_EXPERT_ROWS rows take this kernel, experts with more the Triton kernel's
# 64-row tiles (two launches, each over its own tile list): an 8-row tile unpacks its expert's weights again for
# every 8 rows, so from 3 tiles an expert costs more here than in one Triton tile at ~25% of copy. H200, session
# 29 (``gpu_model_slice.py --quant fp8+fp4``, whose random routers send V4.1's 1536 rows at batch 256 to ~90
# experts, ~17 rows each): all experts here made that step 23.2 -> 28.0 ms while batch 64 (~6 rows an expert)
# went 13.1 -> 9.7 ms. The split at 8 / 16 / 32 rows: a V4.1 batch-256 graph step of 18.1 / 17.5 / 17.4 ms (same
# lease, ``profile_decode_quant_h200_session29.log``); 16 keeps an expert at two tiles here.
MAX_EXPERT_ROWS = 16


def _cols(cfg: dict, fuse_swiglu: bool) -> int:
    """Output columns a program."""
    return cfg["BLOCK_N"] // 2 if fuse_swiglu else cfg["BLOCK_N"]


def _fallback(k: int, cfg: dict) -> bool:
    return k % (2 * cfg["BKH"]) != 0


def _launch(grid, x, w, w_scale, out, row_scale, experts, index, r0, r1, n_out, *, sorted_rows, fuse_swiglu,
            swiglu_limit, cfg):  # fmt: skip
    xs = x.to(torch.bfloat16).contiguous()  # the MMA operand is bf16 (fp16 / fp32 inputs are rounded)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    _expert_rows_kernel[grid](
        xs, w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8), out, rs,
        experts, index, r0, r1, n_out, x.shape[1], float(swiglu_limit) if swiglu_limit is not None else 0.0,
        SORTED=sorted_rows, FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=index is not experts, BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"], NUM_WARPS=cfg["num_warps"],
        num_warps=cfg["num_warps"],
    )  # fmt: skip
    return out


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
    if _fallback(x.shape[1], cfg):
        return mxfp4_grouped_gemm_gather_triton(
            x, w, w_scale, row_expert, row_index=row_index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit,
            row_scale=row_scale, out_dtype=out_dtype,
        )  # fmt: skip
    p = row_expert.shape[0]
    out = expert_out(p, w, fuse_swiglu, out_dtype, x.device)
    n_out = out.shape[1]
    if p == 0 or n_out == 0:
        return out
    experts = row_expert.contiguous()
    index = row_index.contiguous() if row_index is not None else experts
    grid = (p, triton.cdiv(n_out, _cols(cfg, fuse_swiglu)))
    return _launch(grid, x, w, w_scale, out, row_scale, experts, index, experts, experts, n_out, sorted_rows=False,
                   fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, cfg=cfg)  # fmt: skip


def mxfp4_grouped_gemm_gluon(
    x, w, w_scale, expert_offsets, *, fuse_swiglu=False, swiglu_limit=None, row_scale=None, out_dtype=torch.bfloat16
):
    """Sorted (contiguous) layout: experts with at most MAX_EXPERT_ROWS rows in tiles of TILE_ROWS rows here, the
    others in the Triton kernel's tiles (``grouped_rows_into``); K not a multiple of 2 * BKH: all in Triton."""
    cfg = SORTED_CFG
    rows = x.shape[0]
    if _fallback(x.shape[1], cfg):
        return mxfp4_grouped_gemm_triton(
            x, w, w_scale, expert_offsets, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale,
            out_dtype=out_dtype,
        )  # fmt: skip
    out = expert_out(rows, w, fuse_swiglu, out_dtype, x.device)
    n_out = out.shape[1]
    if rows == 0 or n_out == 0:
        return out
    tile_e, tile_r0, tile_r1, slots = expert_tile_schedule(expert_offsets, rows, TILE_ROWS, max_rows=MAX_EXPERT_ROWS)
    grid = (slots, triton.cdiv(n_out, _cols(cfg, fuse_swiglu)))
    _launch(grid, x, w, w_scale, out, row_scale, tile_e, tile_e, tile_r0, tile_r1, n_out, sorted_rows=True,
            fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, cfg=cfg)  # fmt: skip
    if rows > MAX_EXPERT_ROWS:  # else no expert can have more
        grouped_rows_into(out, x, w, w_scale, expert_offsets, min_rows=MAX_EXPERT_ROWS + 1, fuse_swiglu=fuse_swiglu,
                          swiglu_limit=swiglu_limit, row_scale=row_scale)  # fmt: skip
    return out


register_backend(
    "mxfp4_grouped_gemm_gather",
    "gluon",
    mxfp4_grouped_gemm_gather_gluon,
    devices=("cuda",),
    priority=30,
    available=_cuda_available,
    batch_invariant=True,
)
# Not batch-invariant: an expert's row count picks this kernel or the Triton one (different sum orders).
register_backend(
    "mxfp4_grouped_gemm", "gluon", mxfp4_grouped_gemm_gluon, devices=("cuda",), priority=30, available=_cuda_available
)

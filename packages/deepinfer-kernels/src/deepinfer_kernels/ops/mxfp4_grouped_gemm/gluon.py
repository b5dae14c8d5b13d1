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
* E2M1 -> bf16 by bit moves in inline PTX (``gluon_common.py``).

Products are exact (an E2M1 value times a power of two fits bf16), sums are fp32 in the tensor cores: results
differ from the reference only in the order of the fp32 sums. Scale bytes 0 and 255 are outside what the
multiply honours (the block becomes zero / inf instead of 2^-127 / NaN), as in the Triton backend; neither occurs
in the checkpoints or from ``mxfp4_quantize``. The tiling is fixed and an output column depends only on its own x
row, so rows are bitwise independent of the others. The gathered backend is registered batch-invariant; the
sorted one is not (an expert's row count chooses between this kernel, the wgmma one of ``gluon_wgmma.py`` for
experts of 9-32 rows, and the Triton one or, in prefill calls, the TMA-fed one of ``gluon_tma.py``, whose sums
differ in order).

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

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import hopper, pdl_options, sm90_or_newer
from deepinfer_kernels.ops.grouped_gemm.triton import expert_epilogue, expert_out
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedules
from deepinfer_kernels.registry import register_backend

from .gluon_common import expert_weight_rows, fold_for, load_unpacked
from .gluon_tma import tma_rows_into, tma_supported, tma_tile_specs
from .gluon_wgmma import wgmma_rows_into, wgmma_tile_spec
from .triton import (
    grouped_rows_into,
    grouped_tile_spec,
    mxfp4_grouped_gemm_gather_triton,
    mxfp4_grouped_gemm_triton,
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
def _rows_dot(w_rows, s_rows, k0, kh, x_even, x_odd, acc, FOLD: gl.constexpr):
    """acc + (rows of one expert, packed byte columns k0 .. k0 + BKH) . x: w_rows / s_rows the row pointers."""
    lo, hi = load_unpacked(w_rows, s_rows, k0, kh, FOLD)
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
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, expert_ptr, index_ptr, r0_ptr, r1_ptr, N_OUT, K, limit, RPI,
    SORTED: gl.constexpr, FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr,
    HAS_INDEX: gl.constexpr, BLOCK_N: gl.constexpr, BKH: gl.constexpr, NUM_WARPS: gl.constexpr,
    FOLD: gl.constexpr = False, PDL: gl.constexpr = False,
):  # fmt: skip
    """Program (p, pid_n): BLOCK_N weight rows (FUSE: BLOCK_N / 2 gate and as many up rows) of one expert
    against up to 8 rows of x, the MMA's 8 B columns. SORTED: p is a tile slot (``expert_tile_schedule``:
    expert_ptr / r0_ptr / r1_ptr give its expert (-1: empty) and rows [r0, r1), at most 8; row r reads x[r], with
    HAS_INDEX x[index_ptr[r]]); else p is a gathered row (expert_ptr[p], input row index_ptr[p] with HAS_INDEX,
    else p // RPI) in all 8 columns, column 0 stored. FOLD: one multiply a weight pair (``gluon_common.fold_ok``)."""
    pdl_prologue(PDL)  # a triton.jit helper: Gluon calls it
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
            if HAS_INDEX:
                x_rows = gl.load(index_ptr + x_rows).to(gl.int64)
        else:
            src = p // RPI
            if HAS_INDEX:
                src = gl.load(index_ptr + p).to(gl.int64)
            x_rows = src + 0 * nx
        KH = K // 2
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA))
        n0, w_rows, s_rows = expert_weight_rows(w_ptr, s_ptr, e, j, pid_n, N_OUT, K, BLOCK_N, FUSE)
        kh = gl.arange(0, BKH, layout=gl.SliceLayout(0, LA))
        kx = gl.arange(0, 2 * BKH, layout=gl.SliceLayout(1, LX))
        x_tile = x_ptr + x_rows[None, :] * K + kx[:, None]
        acc = gl.zeros([BLOCK_N, 8], gl.float32, MMA)
        for k0 in range(0, KH, BKH):
            x_pairs = gl.permute(gl.reshape(gl.load(x_tile + 2 * k0), [BKH, 2, 8]), [0, 2, 1])
            x_even, x_odd = x_pairs.split()
            x_even = gl.convert_layout(x_even, LB, assert_trivial=True)
            x_odd = gl.convert_layout(x_odd, LB, assert_trivial=True)
            acc = _rows_dot(w_rows, s_rows, k0, kh, x_even, x_odd, acc, FOLD)
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
# Tried and removed (session 35, H100, V4.1 cold us, none / one / two steps ahead at 128-byte steps): each step's
# weight bytes requested one or two steps earlier as int32 words (the TMA kernel's ``load_words``): one token
# gate/up 41.1 / 55.9 / 56.6, down 20.7 / 19.4 / 27.5; 8 tokens 264 / 263 / 281 and 137 / 133 / 133; 64 tokens
# 1482 / 1473 / 1533 and 728 / 730 / 724 (71-76% of copy already); 64-byte steps slower in every case
# (``benchmarks/baselines/session35_h100.log``).
GATHER_CFG = {"BLOCK_N": 64, "BKH": 128, "num_warps": 4}
SORTED_CFG = {"BLOCK_N": 64, "BKH": 128, "num_warps": 4}
TILE_ROWS = 8  # rows a sorted-layout tile (the MMA's N)
# Sorted layout: the experts are split by row count between kernels, each over its own tile list
# (``expert_tile_schedule`` bounds), because a kernel pays an expert's weight bytes once per tile. Calls of at least
# WGMMA_FROM_ROWS rows: up to MMA_MAX_ROWS rows in this kernel's 8-row tiles (a pass at ~58% of copy), up to
# WGMMA_MAX_ROWS in the wgmma kernel's 32-row tiles (``gluon_wgmma.py``, sm_90; a pass at ~43%), more in the Triton
# kernel's 64-row tiles (prefill; ~25%, but its tensor-core work grows with the rows). Smaller calls: up to
# SMALL_MMA_MAX_ROWS rows here (two tiles at most), more in Triton: one launch and tile list fewer.
# H200, V4.1 slice (``gpu_model_slice.py --quant fp8+fp4``, random routers: at batch 256 ~90 experts of ~17 rows),
# same lease, 2 alternating rounds (``ab_slice.py``), the three-kernel split against the two-kernel one at every
# batch: batch 8 3.73 vs 3.67 ms, 64 8.32 vs 8.19, 256 16.40 vs 16.98 (session 30); session 29's two-kernel split
# at 8 / 16 / 32 rows: 18.1 / 17.5 / 17.4 ms at batch 256.
MMA_MAX_ROWS = 8
WGMMA_MAX_ROWS = 32
WGMMA_FROM_ROWS = 1024
SMALL_MMA_MAX_ROWS = 16
# Gate/up calls of at least TALL_ROWS_PER_EXPERT rows per expert on average (rows >= this x E) take Triton tiles of
# TALL_BLOCK_M rows: a 64-row tile unpacks each weight tile for half as many rows, but a tall tile of a small
# expert is mostly padding; None: off. H100, session 33, gate/up at 8192 tokens x 6 rows (CUDA events; 64 ->
# 128-row tiles, one run): 10.87 -> 10.01 ms over 384 experts (128 rows an expert), 8.82 -> 7.60 ms over 96
# (512), but 2048 tokens over 384 (32 rows an expert, two runs) 5.0 -> 6.75 ms; the V4.1 slice's prefill at 8K
# 33% -> 38% of the tensor-core floor. The down GEMM measured slower at 128 (5.15 -> 5.89 ms at 8192 tokens)
# and stays at 64; 8 warps were slower in both; 128-row tiles on every call cost a decode step at batch 64 ~0.2 ms.
TALL_ROWS_PER_EXPERT: int | None = 64
TALL_BLOCK_M = 128
# Calls of at least TMA_FROM_ROWS rows (sm_90, K a multiple of 256): the experts past the last Gluon kernel's rows
# go to the TMA-fed pipelined wgmma kernel (``gluon_tma.py``) instead of the Triton tiles; None: never. H100,
# session 34, V4.1 gate/up + down ms over 384 experts (uniform routing; Triton -> TMA): 8192 tokens 17.49 -> 14.29,
# 4096 12.03 -> 10.54; 2048 (32 an expert) 8.45 either way, and 9.42 with the kernel from 32 (its 128-row tiles
# half empty); the V4.1 slice's 8K prefill 37.7% -> 43.5% of the tensor-core floor. Session 36 (H100, V4.1 slice,
# ``ab_slice.py``, two rounds in either order): also the decode calls from WGMMA_FROM_ROWS rows (session 34 took
# only calls of 64 rows an expert) cut batch 256 by 0.93-1.0 ms of 15.2 (the slice's skewed routers give experts
# of 33-100 rows; Triton ran 3.6-3.9 ms of that step); TN 32 / 64 tiles instead of 128 were no better there.
TMA_FROM_ROWS: int | None = 1024
# In the TMA kernel's calls of at least TMA_TAIL_FROM_ROWS rows, each expert's 1 .. TMA_TAIL_ROWS rows past its
# last full 128-row tile go to that kernel's tiles of TMA_TAIL_ROWS rows (``gluon_tma.tma_tile_specs``; a multiple
# of 16, None: off): a tile unpacks the expert's weights whatever its rows, so an expert's last few rows cost nearly
# a full tile. H100, session 37 (``.gpu``-style CUDA events after a 256 MB flush, gate/up + down ms, tails None /
# 16 / 32 / 64): 8192 tokens x 6 over 384 experts, uniform 12.82 / 11.69 / 11.42 / 12.11 (185 experts with a tail of
# at most 32), skewed 10.58 / 10.54 / 10.42 / 10.40, heavy-tailed 12.16 / 12.20 / 12.36 / 13.15; the V4.1 slice's
# 8K prefill (skewed random routers) unchanged within noise (86.7 / 86.9 ms, three rounds). Decode calls have no
# expert past 128 rows to split and paid the tail list's launch: batch 256 +133 us (three rounds), hence the bound.
TMA_TAIL_ROWS: int | None = 32
TMA_TAIL_FROM_ROWS = 8192


def _cols(cfg: dict, fuse_swiglu: bool) -> int:
    """Output columns a program."""
    return cfg["BLOCK_N"] // 2 if fuse_swiglu else cfg["BLOCK_N"]


def _fallback(k: int, cfg: dict) -> bool:
    return k == 0 or k % (2 * cfg["BKH"]) != 0


def _launch(grid, x, w, w_scale, out, row_scale, experts, index, r0, r1, n_out, *, sorted_rows, fuse_swiglu,
            swiglu_limit, cfg, rows_per_input=1):  # fmt: skip
    xs = x.to(torch.bfloat16).contiguous()  # the MMA operand is bf16 (fp16 / fp32 inputs are rounded)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    _expert_rows_kernel[grid](
        xs, w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8), out, rs,
        experts, index, r0, r1, n_out, x.shape[1], float(swiglu_limit) if swiglu_limit is not None else 0.0,
        rows_per_input, SORTED=sorted_rows, FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None,
        HAS_RS=row_scale is not None, HAS_INDEX=index is not experts, BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"],
        NUM_WARPS=cfg["num_warps"], FOLD=fold_for(w_scale), num_warps=cfg["num_warps"],
        **pdl_options(xs.device),
    )  # fmt: skip
    return out


def mxfp4_grouped_gemm_gather_gluon(
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
    """Gathered layout (see module docstring); K not a multiple of 2 * BKH goes to the Triton kernel."""
    cfg = GATHER_CFG
    if _fallback(x.shape[1], cfg):
        return mxfp4_grouped_gemm_gather_triton(
            x, w, w_scale, row_expert, row_index=row_index, rows_per_input=rows_per_input, fuse_swiglu=fuse_swiglu,
            swiglu_limit=swiglu_limit, row_scale=row_scale, out_dtype=out_dtype,
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
                   fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, cfg=cfg,
                   rows_per_input=rows_per_input)  # fmt: skip


def mxfp4_grouped_gemm_gluon(
    x, w, w_scale, expert_offsets, *, row_index=None, fuse_swiglu=False, swiglu_limit=None, row_scale=None,
    out_dtype=torch.bfloat16,
):  # fmt: skip
    """Sorted (contiguous) layout: the experts split by row count between this kernel's tiles of TILE_ROWS rows,
    the wgmma kernel's (sm_90, calls of WGMMA_FROM_ROWS rows or more) and, for the larger experts, the TMA kernel's
    (sm_90, calls of TMA_FROM_ROWS rows or more, K a multiple of 256) or the Triton kernel's
    (``grouped_rows_into``; taller tiles for gate/up calls of TALL_ROWS_PER_EXPERT rows an expert or more), as the
    constants above say; K not a multiple of 2 * BKH: all in Triton. Every kernel reads x through ``row_index``
    when given (the TMA kernel's relabelled copy is gathered through it)."""
    cfg = SORTED_CFG
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    if _fallback(x.shape[1], cfg):
        return mxfp4_grouped_gemm_triton(
            x, w, w_scale, expert_offsets, row_index=row_index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit,
            row_scale=row_scale, out_dtype=out_dtype,
        )  # fmt: skip
    out = expert_out(rows, w, fuse_swiglu, out_dtype, x.device)
    n_out = out.shape[1]
    if rows == 0 or n_out == 0:
        return out
    xs = x.to(torch.bfloat16).contiguous()  # the MMA operand is bf16 (fp16 / fp32 inputs are rounded)
    index = row_index.contiguous() if row_index is not None else None
    epi = dict(row_index=index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale)
    large = hopper(x.device) and rows >= WGMMA_FROM_ROWS
    wgmma = large and WGMMA_MAX_ROWS > MMA_MAX_ROWS
    mma_max = MMA_MAX_ROWS if wgmma else SMALL_MMA_MAX_ROWS
    rest_from = (WGMMA_MAX_ROWS if wgmma else mma_max) + 1  # the experts of the last kernel, TMA or Triton
    rest = rows >= rest_from  # else no expert has that many rows
    n_exp = w.shape[0]
    tma = hopper(x.device) and TMA_FROM_ROWS is not None and rows >= TMA_FROM_ROWS and tma_supported(x.shape[1])
    tall = fuse_swiglu and TALL_ROWS_PER_EXPERT is not None and rows >= TALL_ROWS_PER_EXPERT * n_exp
    block_m = TALL_BLOCK_M if tall else None
    specs = []  # every kernel's tile list, built in one launch
    if mma_max > 0:
        specs.append((TILE_ROWS, 0, mma_max))
    if wgmma:
        specs.append(wgmma_tile_spec(mma_max + 1, WGMMA_MAX_ROWS))
    tail_rows = TMA_TAIL_ROWS if rows >= TMA_TAIL_FROM_ROWS else None
    if rest:
        specs += tma_tile_specs(rest_from, tail_rows) if tma else [grouped_tile_spec(rest_from, block_m)]
    lists = iter(expert_tile_schedules(expert_offsets, rows, specs))
    if mma_max > 0:
        tile_e, tile_r0, tile_r1, slots = next(lists)
        grid = (slots, triton.cdiv(n_out, _cols(cfg, fuse_swiglu)))
        _launch(grid, xs, w, w_scale, out, row_scale, tile_e, tile_e if index is None else index, tile_r0, tile_r1,
                n_out, sorted_rows=True, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, cfg=cfg)  # fmt: skip
    if wgmma:
        wgmma_rows_into(out, xs, w, w_scale, expert_offsets, min_rows=mma_max + 1, max_rows=WGMMA_MAX_ROWS,
                        tiles=next(lists), **epi)  # fmt: skip
    if not rest:
        return out
    if tma:
        return tma_rows_into(out, xs, w, w_scale, expert_offsets, min_rows=rest_from, tail_rows=tail_rows,
                             tiles=list(lists), **epi)  # fmt: skip
    return grouped_rows_into(out, xs, w, w_scale, expert_offsets, min_rows=rest_from, block_m=block_m,
                             tiles=next(lists), **epi)  # fmt: skip


register_backend(
    "mxfp4_grouped_gemm_gather",
    "gluon",
    mxfp4_grouped_gemm_gather_gluon,
    devices=("cuda",),
    priority=30,
    available=sm90_or_newer,
    batch_invariant=True,
)
# Not batch-invariant: an expert's row count picks this kernel or the Triton one (different sum orders).
register_backend(
    "mxfp4_grouped_gemm", "gluon", mxfp4_grouped_gemm_gluon, devices=("cuda",), priority=30, available=sm90_or_newer
)

"""Gluon wgmma kernel of the sorted-layout MXFP4 expert GEMM, for experts with a few dozen rows (a decode batch of
64-256 tokens routes ~10-40 rows to each expert it hits): sm_90 only (wgmma is Hopper's).

Operands swapped, as in the ``mma.sync`` kernel (``gluon.py``): the weights are the wide A operand and the x
rows the B columns, so an expert's weights are unpacked once for TN = 32 rows instead of once per 8.

* A from registers: a warp's 16 weight rows are unpacked in registers (``gluon_common``) from 64-bit loads of 8
  consecutive packed bytes a thread. wgmma's register A layout holds k pairs (k_width 2), so K is relabelled
  rather than shuffled: within 32 packed bytes, byte 8q + 2a + b (thread q of a quad) is logical column 8a + 2q +
  b, and x goes to shared memory under the same relabelling (``relabel_k``), so the dot product is unchanged.
* B from shared memory: each step the program loads its TN x rows (128-bit loads), splits the even and odd
  columns (the low and high nibbles' operands) and stores both, relabelled, to NVMMA-swizzled tiles.
* Synchronous wgmma (wait 0 each step): a register A operand must stay untouched until its wgmma completes, and
  a deeper pipeline measured no faster (the step is bound by load latency: ~5 programs an SM at 96 registers).
  The wait sits inside the loop on purpose: with a wait after it, the path that skips the loop defines the
  accumulator between wgmma and wait, and ptxas then serialises every wgmma (its warning C7515).

Epilogue as ``gluon.py``'s: with FUSE gate and up rows interleave by 8 within a warp's 16, so a thread holds the
gate and the up sum of an output column (thread-local SwiGLU). Results differ from the reference only in the
order of the fp32 sums; an output column depends only on its own x row (tiling fixed), so rows are independent.

Measured on an H200 (session 30, V4.1 shapes, CUDA graphs after a 256 MB copy, us gate/up + down, % of copy of the
experts' weight bytes; ``bench_mxfp4_gather_cold.py``): 256 tokens over 90 experts (~17 rows each) 720 + 396 (37 /
34%) through the dispatch against 1018 + 520 with session 29's split (8-row ``mma.sync`` tiles up to 16 rows,
Triton above) and 1132 + 533 in Triton alone; 1024 tokens (~16 rows over 384 experts) 3283 + 1689 against 4068 +
2037. A pass over an expert's weights runs at ~43% of copy (the ``mma.sync`` kernel's 8-row pass ~58%): experts
with up to 8 rows stay there. The prototype sweep (``benchmarks/baselines/mxfp4_wgmma_tilings_h200_session30.log``):
64 rows a program on 4 warps is best; 128 rows (4 or 8 warps sharing the x tile), TN 16 / 64, 128-byte steps and a
register prefetch of the next step were all slower (rerun a tiling: ``bench_mxfp4_gather_cold.py --set
deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon_wgmma.WGMMA_CFG.TN=16``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule

from .gluon_common import expert_weight_rows, fold_for, load_unpacked, relabel_k, store_swapped, weight_load_layout


@gluon.jit
def _expert_rows_wgmma_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, rs_ptr, tile_e_ptr, r0_ptr, r1_ptr, index_ptr, N_OUT, K, limit,
    FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr, HAS_INDEX: gl.constexpr,
    TN: gl.constexpr, BLOCK_N: gl.constexpr, BKH: gl.constexpr, X_SL: gl.constexpr, NUM_WARPS: gl.constexpr,
    FOLD: gl.constexpr = False, PDL: gl.constexpr = False,
):  # fmt: skip
    """Program (slot p, pid_n): BLOCK_N weight rows (FUSE: BLOCK_N / 2 gate and as many up rows, interleaved by 8)
    of tile p's expert against its rows [r0, r1) (at most TN; ``expert_tile_schedule``, expert -1: empty slot).
    x: [R, K] bf16 (HAS_INDEX: row r reads x[index[r]]); w: [E, N, K / 2] packed E2M1; s: [E, N, K / 32] UE8M0
    bytes; out: [R, N_OUT]."""
    pdl_prologue(PDL)  # a triton.jit helper: Gluon calls it
    p = gl.program_id(0).to(gl.int64)
    pid_n = gl.program_id(1)
    e = gl.load(tile_e_ptr + p).to(gl.int64)
    if e >= 0:
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, TN, 16]
        )
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        LW: gl.constexpr = weight_load_layout(NUM_WARPS, 8)  # uint8: 8 consecutive packed bytes a thread
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (2 * BKH // 8), 2 * BKH // 8], [NUM_WARPS, 1], [1, 0])
        r0 = gl.load(r0_ptr + p).to(gl.int64)
        r1 = gl.load(r1_ptr + p).to(gl.int64)
        KH = K // 2
        rows = gl.minimum(r0 + gl.arange(0, TN, layout=gl.SliceLayout(1, XL)), r1 - 1)  # past r1: never stored
        if HAS_INDEX:
            rows = gl.load(index_ptr + rows).to(gl.int64)
        x_tile = x_ptr + rows[:, None] * K + gl.arange(0, 2 * BKH, layout=gl.SliceLayout(0, XL))[None, :]
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
        n0, w_rows, s_rows = expert_weight_rows(w_ptr, s_ptr, e, j, pid_n, N_OUT, K, BLOCK_N, FUSE)
        kh = gl.arange(0, BKH, layout=gl.SliceLayout(0, LW))
        xe_s = gl.allocate_shared_memory(gl.bfloat16, [TN, BKH], X_SL)
        xo_s = gl.allocate_shared_memory(gl.bfloat16, [TN, BKH], X_SL)
        acc = gl.zeros([BLOCK_N, TN], gl.float32, ACC)
        for k0 in range(0, KH, BKH):
            xv = gl.load(x_tile + 2 * k0)
            lo, hi = load_unpacked(w_rows, s_rows, k0, kh, FOLD)
            x_even, x_odd = gl.reshape(xv, [TN, BKH, 2]).split()
            gl.thread_barrier()  # the previous step's wgmma (waited for) and every warp are past the tiles
            xe_s.store(relabel_k(x_even))
            xo_s.store(relabel_k(x_odd))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(gl.convert_layout(relabel_k(lo), LA), xe_s.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(gl.convert_layout(relabel_k(hi), LA), xo_s.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        EPI: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (TN // 4), TN // 4], [NUM_WARPS, 1], [1, 0])
        store_swapped(acc, EPI, out_ptr, rs_ptr, n0, r0, r1, N_OUT, limit, FUSE, HAS_LIMIT, HAS_RS)


# Fixed tiling (session 30 sweep on the H200, see the module docstring): TN rows a tile, 64 weight rows a program
# (16 a warp), 64 packed bytes (128 columns) a step.
WGMMA_CFG = {"TN": 32, "BLOCK_N": 64, "BKH": 64, "num_warps": 4}


def wgmma_meta(cfg: dict) -> dict:
    """The kernel's layout constexprs for a tiling."""
    return dict(
        TN=cfg["TN"], BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"], NUM_WARPS=cfg["num_warps"],
        X_SL=gl.NVMMASharedLayout.get_default_for([cfg["TN"], cfg["BKH"]], gl.bfloat16),
    )  # fmt: skip


def wgmma_tile_spec(min_rows: int, max_rows: int) -> tuple[int, int, int]:
    """The (BLOCK_M, min_rows, max_rows) of ``wgmma_rows_into``'s tile list (``expert_tile_schedules``)."""
    return (WGMMA_CFG["TN"], min_rows, max_rows)


def wgmma_rows_into(out, xs, w, w_scale, expert_offsets, *, min_rows, max_rows, row_index=None, fuse_swiglu=False,
                    swiglu_limit=None, row_scale=None, tiles=None):  # fmt: skip
    """The sorted layout's rows of the experts with min_rows <= rows <= max_rows (bounds inclusive), written into
    ``out`` ([R, N] or [R, N/2]; other rows untouched). xs: [R, K] bf16 contiguous, K % (2 * BKH) == 0; or, with
    ``row_index`` ([R] int, contiguous), [R_in, K] read through it. ``tiles``: the tile list of
    ``wgmma_tile_spec(min_rows, max_rows)``, when the caller built it already."""
    cfg = WGMMA_CFG
    rows, k = out.shape[0], xs.shape[1]
    n_out = out.shape[1]
    if rows == 0 or n_out == 0:
        return out
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    tile_e, r0, r1, slots = tiles or expert_tile_schedule(expert_offsets, rows, *wgmma_tile_spec(min_rows, max_rows))
    cols = cfg["BLOCK_N"] // 2 if fuse_swiglu else cfg["BLOCK_N"]
    _expert_rows_wgmma_kernel[(slots, triton.cdiv(n_out, cols))](
        xs, w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8), out, rs, tile_e, r0, r1,
        row_index if row_index is not None else tile_e, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None,
        HAS_INDEX=row_index is not None, FOLD=fold_for(w_scale), num_warps=cfg["num_warps"], **wgmma_meta(cfg),
        **pdl_options(xs.device),
    )  # fmt: skip
    return out

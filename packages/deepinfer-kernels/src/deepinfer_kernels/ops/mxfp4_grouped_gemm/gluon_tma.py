"""Gluon kernel of the sorted-layout MXFP4 expert GEMM for experts with many rows (prefill, and the experts past 32
rows of decode calls of ``gluon.TMA_FROM_ROWS`` rows or more): sm_90 only (wgmma, TMA). The x tiles stream
through a ring of shared-memory stages fed by TMA while the weights are unpacked in registers and multiplied by
asynchronous wgmma.

Operands swapped as in ``gluon_wgmma.py`` (the decode kernel this one grows from): the weights are the A operand,
unpacked in registers (``gluon_common``) from 64-bit loads of 8 consecutive packed bytes a thread, BLOCK_N rows a
program (16 a warp, 64 a warpgroup); the x rows are the B operand's TN columns, from shared memory. The grid runs
a row tile's column tiles together (pid_n is axis 0), so an expert's x tiles are read from HBM once and from L2
by the others (with the row tiles on axis 0 each x tile came from HBM once per column tile: 0.83x the Triton
kernel instead of 1.15x).

* x relabelled once per call (``relabel_x``): wgmma's register A layout holds k pairs, so a thread's 8 packed
  bytes are 16 logical columns only after relabelling K within each 32 packed bytes (``gluon_common.relabel_k``)
  and splitting the even (low nibble) from the odd (high nibble) columns. The decode kernel does that in
  registers each step; here a copy of x laid out that way lets TMA load the B tiles as they are, so that no
  thread touches x in the main loop. Given the sort's row index, the copy gathers the token-major x through it,
  so the sorted copy of x is never written.
* 128-row x tiles, and for each expert's last 1 .. ``tail_rows`` rows past a full tile a second launch of tiles of
  that many rows (``tma_tile_specs``): a tile unpacks its 64 weight rows whatever its x rows.
* A ring of STAGES x tiles (even and odd halves) with an mbarrier each: step i's tiles were requested
  STAGES - 1 steps earlier; a stage is refilled once every warp has retired the wgmma that read it.
* wgmma asynchronous one step deep: step i's unpacking runs while step i - 1's wgmma is in flight. The loop is
  unrolled by two so that the two steps' A operands are distinct registers: a register operand must stay
  untouched until its wgmma retires, and one set rewritten every step would make ptxas serialise the wgmma (its
  warning C7515).
* The weight bytes two steps ahead, as int32 words (``load_words``): carried across steps, a uint8 tensor holds a
  byte a register and was split and repacked every step (244 -> 40 PRMT an unrolled step pair, 212 -> 204
  registers; 3-5% faster).

Epilogue as ``gluon_wgmma.py``'s (fused gate/up rows interleaved by 8 within a warp's 16: thread-local SwiGLU),
with the stores laid out along the output columns. Results differ from the reference only in the order of the
fp32 sums; an output column depends only on its own x row (the tiling is fixed), so rows are independent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options
from deepinfer_kernels.ops.grouped_tiles import TileSpec, expert_tile_schedules, tail_split

from .gluon_common import (
    expert_weight_rows,
    fold_for,
    load_words,
    relabel_k,
    store_swapped,
    unpack_words,
    weight_load_layout,
)


def relabel_x_ref(xs: torch.Tensor, bkh: int) -> torch.Tensor:
    """[R, K] -> [R, K]: each chunk of 2 * bkh columns rewritten as (its even columns, its odd columns), each half
    relabelled as ``relabel_k`` does (packed index 32c + 8q + 2a + b to 32c + 8a + 2q + b). The definition
    ``relabel_x`` is tested against."""
    r, k = xs.shape
    v = xs.reshape(r, k // (2 * bkh), bkh // 32, 4, 4, 2, 2)  # (chunk, c, q, a, b, nibble)
    return v.permute(0, 1, 6, 2, 4, 3, 5).reshape(r, k)


@triton.jit
def _relabel_kernel(x_ptr, y_ptr, index_ptr, R, K, BR: tl.constexpr, BKH: tl.constexpr, HAS_INDEX: tl.constexpr,
                    PDL: tl.constexpr = False):  # fmt: skip
    """y[rows, chunk] = x[rows, chunk] (HAS_INDEX: x[index[rows], chunk]) relabelled (``relabel_x_ref``): BR rows
    x one chunk of 2 * BKH columns a program, loaded and stored contiguously, permuted in registers."""
    pdl_prologue(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * (2 * BKH) + tl.arange(0, 2 * BKH)
    ok = (rows < R)[:, None]
    src = rows
    if HAS_INDEX:
        src = tl.load(index_ptr + rows, mask=rows < R, other=0).to(tl.int64)
    v = tl.load(x_ptr + src[:, None] * K + cols[None, :], mask=ok)
    v = tl.reshape(v, (BR, BKH // 32, 4, 4, 2, 2))  # (row, c, q, a, b, nibble)
    v = tl.reshape(tl.permute(v, (0, 5, 1, 3, 2, 4)), (BR, 2 * BKH))
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], v, mask=ok)


def relabel_x(xs: torch.Tensor, bkh: int, row_index: torch.Tensor | None = None) -> torch.Tensor:
    """``relabel_x_ref`` in one launch: [R, K] contiguous, K a multiple of 2 * bkh, bkh a multiple of 32; with
    ``row_index`` ([R] int), of xs[row_index] (xs [R_in, K]) without that copy."""
    r = xs.shape[0] if row_index is None else row_index.shape[0]
    k = xs.shape[1]
    y = xs.new_empty(r, k)
    if r:
        br = 32
        index = row_index.contiguous() if row_index is not None else xs  # dummy pointer when absent
        _relabel_kernel[(triton.cdiv(r, br), k // (2 * bkh))](xs, y, index, r, k, BR=br, BKH=bkh,
                                                               HAS_INDEX=row_index is not None, num_warps=4,
                                                               **pdl_options(xs.device))  # fmt: skip
    return y


@gluon.jit
def _issue_x(x_desc, bars, xe_s, xo_s, step, row0, BKH: gl.constexpr):
    """Request step ``step``'s x tiles (even and odd halves of its 2 * BKH relabelled columns) into its stage."""
    slot = step % xe_s.shape[0]
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row0, 2 * BKH * step], bar, xe_s.index(slot))
    tma.async_copy_global_to_shared(x_desc, [row0, 2 * BKH * step + BKH], bar, xo_s.index(slot))


@gluon.jit
def _step(acc, packed, s, step, n_steps, w_rows, s_rows, kw, x_desc, bars, xe_s, xo_s, row0,
          LA: gl.constexpr, BKH: gl.constexpr, FOLD: gl.constexpr):  # fmt: skip
    """One K step: the weight bytes of step + 2 requested, this step's unpacked and multiplied (wgmma left in
    flight), the previous step's wgmma retired and its stage refilled. Returns (acc, packed, scales) of the step
    requested."""
    STAGES: gl.constexpr = xe_s.shape[0]
    nxt = gl.minimum(step + 2, n_steps - 1)  # the last two steps reload the last (never used)
    packed_n, s_n = load_words(w_rows, s_rows, nxt * BKH, kw)
    lo, hi = unpack_words(packed, s, FOLD)
    a_lo = gl.convert_layout(relabel_k(lo), LA)
    a_hi = gl.convert_layout(relabel_k(hi), LA)
    slot = step % STAGES
    mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
    acc = warpgroup_mma(a_lo, xe_s.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(a_hi, xo_s.index(slot).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))  # step - 1's two retired
    gl.thread_barrier()  # every warp is past step - 1's stage
    refill = step + STAGES - 1
    if refill < n_steps:
        _issue_x(x_desc, bars, xe_s, xo_s, refill, row0, BKH)
    return acc, packed_n, s_n


@gluon.jit
def _expert_rows_tma_kernel(
    x_desc, w_ptr, s_ptr, out_ptr, rs_ptr, tile_e_ptr, r0_ptr, r1_ptr, N_OUT, K, limit,
    FUSE: gl.constexpr, HAS_LIMIT: gl.constexpr, HAS_RS: gl.constexpr,
    TN: gl.constexpr, BLOCK_N: gl.constexpr, BKH: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
    FOLD: gl.constexpr = False, PDL: gl.constexpr = False,
):  # fmt: skip
    """Program (pid_n, slot p): BLOCK_N weight rows (FUSE: BLOCK_N / 2 gate and as many up rows, interleaved by 8)
    of tile p's expert against its rows [r0, r1) (at most TN; ``expert_tile_schedule``, expert -1: empty slot).
    x_desc: TMA descriptor of ``relabel_x(x)`` ([R, K] bf16, blocks [TN, BKH]); w: [E, N, K / 2] packed E2M1;
    s: [E, N, K / 32] UE8M0 bytes; out: [R, N_OUT]. K a multiple of 4 * BKH."""
    pdl_prologue(PDL)  # a triton.jit helper: Gluon calls it
    pid_n = gl.program_id(0)  # the column tiles of a row tile run together: its x tiles are read from L2
    p = gl.program_id(1)
    e = gl.load(tile_e_ptr + p).to(gl.int64)
    if e >= 0:
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, TN, 16]
        )
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        LW: gl.constexpr = weight_load_layout(NUM_WARPS, 2)  # int32 words, two (8 packed bytes) a thread
        r0 = gl.load(r0_ptr + p)
        r1 = gl.load(r1_ptr + p)
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LW))
        n0, w_rows, s_rows = expert_weight_rows(w_ptr, s_ptr, e, j, pid_n, N_OUT, K, BLOCK_N, FUSE)
        kw = gl.arange(0, BKH // 4, layout=gl.SliceLayout(0, LW))
        xe_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TN, BKH], x_desc.layout)
        xo_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TN, BKH], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        n_steps = K // (2 * BKH)
        for i in gl.static_range(STAGES - 1):
            if i < n_steps:
                _issue_x(x_desc, bars, xe_s, xo_s, i, r0, BKH)
        acc = gl.zeros([BLOCK_N, TN], gl.float32, ACC)
        # two steps' weight bytes in flight: pa for the even steps, pb for the odd
        pa, sa = load_words(w_rows, s_rows, 0, kw)
        pb, sb = load_words(w_rows, s_rows, BKH, kw)
        for i in range(0, n_steps, 2):  # n_steps is even
            acc, pa, sa = _step(
                acc, pa, sa, i, n_steps, w_rows, s_rows, kw, x_desc, bars, xe_s, xo_s, r0, LA, BKH, FOLD
            )
            acc, pb, sb = _step(
                acc, pb, sb, i + 1, n_steps, w_rows, s_rows, kw, x_desc, bars, xe_s, xo_s, r0, LA, BKH, FOLD
            )
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        # stores along the output columns: 4 consecutive a thread, 64 a half warp
        EPI: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, NUM_WARPS], [0, 1])
        store_swapped(acc, EPI, out_ptr, rs_ptr, n0, r0, r1, N_OUT, limit, FUSE, HAS_LIMIT, HAS_RS)


# Fixed tiling: TN x rows a tile (the wgmma N), BLOCK_N weight rows a program (one warpgroup), BKH packed bytes
# (2 * BKH columns) a step, STAGES x stages (96 KB: two programs an SM). H100, session 34 (V4.1 shapes, 8192
# tokens x 6 over 384 experts, gate/up + down ms with the relabelling, byte loads): this tiling 8.13 + 4.00; two
# warpgroups (BLOCK_N 128, 8 warps) 8.74 + 4.73; TN 256 (8 warps) 9.16 + 5.05 (but 5.98 + 3.36 against
# 6.39 + 3.78 when 96 experts take 512 rows each); TN 64, and the weights one step ahead instead of two, slower in
# every case; 4 stages no faster. Words instead of bytes: 8.15 + 3.93 -> 8.03 + 3.66 (the Triton kernel 10.21 +
# 5.32, torch._grouped_mm on bf16 weights 9.37 + 4.60: bound by their 4x bytes at 128 rows an expert).
TMA_CFG = {"TN": 128, "BLOCK_N": 64, "BKH": 64, "STAGES": 3, "num_warps": 4}
# The fused gate/up calls' tiling over TMA_CFG: two warpgroups (128 weight rows) on one ring of x tiles, 4 stages.
# The kernel is bound by L2 bandwidth, not by its tensor cores: every column program re-reads its x tile from L2
# (ncu, H100, session 38, 8192 tokens over 384 experts: gate/up L2 throughput 87% (7.6 TB/s of reads), tensor pipe
# 46% active, DRAM 31%; down 84% / 57%), and two warpgroups on one x tile halve those reads. H100, bitwise the same
# outputs, gate/up + down ms (``.gpu``-style probe, session 38): 8192 tokens uniform 7.01 + 3.42 -> 6.92 + 3.94
# (this tiling on both) / 6.61 + 3.56 (3 stages); skewed 6.61 + 3.02 -> 5.61 + 3.16 / 6.18 + 3.25; 6 stages in
# between: the down GEMM keeps TMA_CFG, its faster tiling in that probe. V4.1 slice, 8K prefill, with both GEMMs
# on this tiling (the split was not timed in the model: the session's device time ran out): 85.0 / 85.6 -> 80.5 /
# 80.5 ms (43.6 -> 46.3% of the tensor-core floor), 4K 50.2 / 50.1 -> 48.4 / 48.8; decode batch 256 -35 / -50 us,
# batch 64 unchanged (``mxfp4_tma_l2_bound_h100_session38.log``). Session 34 had measured this tiling slower (8.74
# against 8.13 ms) while the weights were loaded as bytes.
TMA_FUSED_CFG = {"BLOCK_N": 128, "STAGES": 4, "num_warps": 8}


def tma_meta(cfg: dict) -> dict:
    """The kernel's layout constexprs for a tiling."""
    return dict(TN=cfg["TN"], BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"], STAGES=cfg["STAGES"],
                NUM_WARPS=cfg["num_warps"])  # fmt: skip


def x_descriptor(x_rel: torch.Tensor, cfg: dict) -> TensorDescriptor:
    """TMA descriptor of ``relabel_x``'s [R, K] output, blocks of [TN, BKH] (128-byte rows: 128-byte swizzle)."""
    block = [cfg["TN"], cfg["BKH"]]
    return TensorDescriptor.from_tensor(x_rel, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def tma_supported(k: int) -> bool:
    """Whether K suits the kernel: a whole number of unrolled step pairs."""
    return k > 0 and k % (4 * TMA_CFG["BKH"]) == 0


def tma_tile_specs(min_rows: int, tail_rows: int | None = None) -> list[TileSpec]:
    """``tma_rows_into``'s tile lists (``expert_tile_schedules``): TN-row tiles of the experts with at least
    ``min_rows`` rows and, with ``tail_rows`` (a multiple of 16 below TN), each such expert's 1 .. tail_rows rows
    past its last full tile in a second list of tail_rows-row tiles (``grouped_tiles.tail_split``)."""
    body = TileSpec(TMA_CFG["TN"], min_rows)
    if tail_rows is None:
        return [body]
    if tail_rows % 16 or not 0 < tail_rows < body.block_m:
        raise ValueError(f"tma_tile_specs: tail_rows must be a multiple of 16 below {body.block_m}, got {tail_rows}")
    return list(tail_split(body, tail_rows))


def tma_rows_into(out, xs, w, w_scale, expert_offsets, *, min_rows, tail_rows=None, row_index=None,
                  fuse_swiglu=False, swiglu_limit=None, row_scale=None, tiles=None):  # fmt: skip
    """The sorted layout's rows of the experts with at least ``min_rows`` rows, written into ``out`` ([R, N] or
    [R, N/2]; other rows untouched): one launch per tile list of ``tma_tile_specs(min_rows, tail_rows)`` (with
    ``tail_rows``, the tails in x tiles of that many rows: the weights are unpacked once a tile whatever its rows,
    so a 128-row tile for an expert's last few rows costs nearly a full one). xs: [R, K] bf16 contiguous,
    ``tma_supported(K)``; or, with ``row_index`` ([R] int), [R_in, K] read through it (by ``relabel_x``, whose
    copy the kernel reads). ``tiles``: those lists, when the caller built them already."""
    rows, k = out.shape[0], xs.shape[1]
    n_out = out.shape[1]
    if rows == 0 or n_out == 0:
        return out
    specs = tma_tile_specs(min_rows, tail_rows)
    lists = tiles or expert_tile_schedules(expert_offsets, rows, specs)
    x_rel = relabel_x(xs, TMA_CFG["BKH"], row_index)
    rs = row_scale.contiguous() if row_scale is not None else xs  # dummy pointer when absent
    w8, s8 = w.contiguous().view(torch.uint8), w_scale.contiguous().view(torch.uint8)
    base = dict(TMA_CFG, **TMA_FUSED_CFG) if fuse_swiglu else TMA_CFG
    cols = base["BLOCK_N"] // 2 if fuse_swiglu else base["BLOCK_N"]
    fold = fold_for(w_scale)
    for spec, (tile_e, r0, r1, slots) in zip(specs, lists, strict=True):
        if slots == 0:  # a tail list of a call without an expert past one tile
            continue
        cfg = dict(base, TN=spec.block_m)
        _expert_rows_tma_kernel[(triton.cdiv(n_out, cols), slots)](
            x_descriptor(x_rel, cfg), w8, s8, out, rs, tile_e, r0, r1, n_out, k,
            float(swiglu_limit) if swiglu_limit is not None else 0.0,
            FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None, HAS_RS=row_scale is not None, FOLD=fold,
            num_warps=cfg["num_warps"], **tma_meta(cfg), **pdl_options(xs.device),
        )  # fmt: skip
    return out

"""Triton backend of the dense expert GEMMs (bf16 tensor cores, fp32 accumulation; any CUDA GPU Triton serves).

One kernel serves both layouts. A program owns a tile of BLOCK_M rows of one expert and BLOCK_N output columns
(with the fused SwiGLU: BLOCK_N gate and BLOCK_N up columns, two accumulators sharing each x tile), walks K in
BLOCK_K steps in order and applies the epilogue (clamped SwiGLU, row scale) before one store:

* contiguous (prefill): the tile list (expert, first row, end row) is built on the device from the offsets
  (``grouped_tiles.expert_tile_schedule``: no host synchronisation); grid = its slots (ceil(R / BLOCK_M) + min(E, R)),
  empty slots return at once; with ``row_index`` a tile reads its input rows through it (the tokens in place);
* gather (decode): tile p holds the single row p in its first lane (the other lanes are masked off, so the
  weight bytes, not the padded MMA rows, bound the time) and reads its input row through ``row_index``.

Products are exact (see the package docstring): bf16 weight tiles are loaded as they are; bf16 activations
feed the tensor cores directly, fp16 / fp32 activations as two / three exact bf16 terms (hi, mid, lo) against
the same weight tile. fp32 weights take IEEE fp32 dots.

Batch invariance: there is no split-K, and every tiling of one weight dtype walks K in the same BLOCK_K steps;
BLOCK_M, BLOCK_N and the warp count only decide which rows and columns a program owns. A row's products and
their order of summation therefore do not depend on the other rows, on its lane in the tile, on the layout or
on which of the contiguous tilings runs (the wide one once the experts average 64 rows or more): measured on
an H200 with Triton 3.6, every bf16 tiling with BLOCK_K = 64 gives the same bits (BLOCK_K = 128 other ones).
Both ops are registered batch-invariant; the GPU tests check a token alone against the same token among 8,
512 and 4096 (gathered, narrow and wide contiguous tilings), bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, triton_cuda_available
from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule
from deepinfer_kernels.registry import register_backend


@triton.jit
def _dot_exact(x, w, acc, TERMS: tl.constexpr, IEEE: tl.constexpr):
    """acc + x . w^T with exact products: IEEE fp32 dots (fp32 weights, or the CPU interpreter, whose bf16 dot
    reads the operands as raw integers in Triton 3.6); else bf16 tensor-core dots of w with the TERMS bf16
    pieces of x (x = hi + mid + lo exactly for fp32, hi + mid for fp16, hi for bf16)."""
    # one static branch each, no early return (Triton 3.6 failed to compile the IEEE path behind one)
    if IEEE:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif TERMS == 1:
        acc = tl.dot(x.to(tl.bfloat16), tl.trans(w), acc)
    else:
        xf = x.to(tl.float32)
        hi = xf.to(tl.bfloat16)
        rest = xf - hi.to(tl.float32)  # exact: the bits of x below hi's last one
        mid = rest.to(tl.bfloat16)
        acc = tl.dot(hi, tl.trans(w), acc)
        acc = tl.dot(mid, tl.trans(w), acc)
        if TERMS == 3:  # the last 8 bits, exact in bf16
            acc = tl.dot((rest - mid.to(tl.float32)).to(tl.bfloat16), tl.trans(w), acc)
    return acc


@triton.jit
def expert_epilogue(acc_g, acc_u, rs, FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr, limit, HAS_RS: tl.constexpr):
    """An expert GEMM's fp32 result: with FUSE the clamped SwiGLU of the (gate, up) accumulators (``swiglu_clamp``'s
    formula, ``tl.exp``), else the plain accumulator; then times the row scale ``rs`` with HAS_RS. Shared by the
    grouped GEMM backends (bf16 / FP8 and MXFP4, Triton and Gluon)."""
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
    x_ptr, w_ptr, out_ptr, rs_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, index_ptr,
    N_OUT, K, limit, ROW_DIV,
    GATHER: tl.constexpr, HAS_INDEX: tl.constexpr, FUSE: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_RS: tl.constexpr, TERMS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # contiguous: axis 0 walks N (the programs of one tile run together and share its x rows in L2); gather:
    # axis 0 walks the rows (no 65535 limit on their number)
    pid_n = tl.program_id(1 if GATHER else 0)
    tile = tl.program_id(0 if GATHER else 1).to(tl.int64)
    lane = tl.arange(0, BLOCK_M)
    if GATHER:  # tile p = output row p alone, in lane 0; tile_e_ptr holds row_expert
        e = tl.load(tile_e_ptr + tile).to(tl.int64)
        src = tile // ROW_DIV  # pair p = t * k + i reads token t (ROW_DIV = k), or row p itself (ROW_DIV = 1)
        if HAS_INDEX:
            src = tl.load(index_ptr + tile).to(tl.int64)
        m_ok = lane == 0
        out_rows = tile + lane
        in_rows = tl.where(m_ok, src, 0)
    else:
        e = tl.load(tile_e_ptr + tile).to(tl.int64)
        out_rows = tl.load(tile_r0_ptr + tile).to(tl.int64) + lane
        m_ok = out_rows < tl.load(tile_r1_ptr + tile)
        in_rows = out_rows
        if HAS_INDEX:  # the sorted row's input row, read in place
            in_rows = tl.load(index_ptr + out_rows, mask=m_ok, other=0).to(tl.int64)
    if e >= 0:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N_OUT
        n_rows = 2 * N_OUT if FUSE else N_OUT
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + in_rows[:, None] * K + rk[None, :]
        wg_ptrs = w_ptr + e * n_rows * K + rn[:, None].to(tl.int64) * K + rk[None, :]
        wu_ptrs = wg_ptrs + N_OUT * K  # up rows follow the gate rows
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x_mask = m_ok[:, None]
                w_mask = n_ok[:, None]
            else:
                k_ok = (k0 + rk) < K
                x_mask = m_ok[:, None] & k_ok[None, :]
                w_mask = n_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs + k0, mask=x_mask, other=0.0)
            acc_g = _dot_exact(x, tl.load(wg_ptrs + k0, mask=w_mask, other=0.0), acc_g, TERMS, IEEE)
            if FUSE:
                acc_u = _dot_exact(x, tl.load(wu_ptrs + k0, mask=w_mask, other=0.0), acc_u, TERMS, IEEE)
        rs = 1.0
        if HAS_RS:
            rs = tl.load(rs_ptr + out_rows, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        y = expert_epilogue(acc_g, acc_u, rs, FUSE, HAS_LIMIT, limit, HAS_RS)
        out_ptrs = out_ptr + out_rows[:, None] * N_OUT + rn[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Tilings per weight dtype. All bf16 ones share BLOCK_K (see the module docstring: a row's bits do not depend on
# the others), and fp32 weights (FMA dots) have one tiling. Gather, and contiguous while the experts average
# fewer than WIDE_MIN_ROWS_PER_EXPERT rows: 64-row tiles keep the padded MMA cheap against the weight stream
# and narrow column blocks give enough programs. Contiguous with more rows: wide tiles, fewer L2 reads per MMA
# flop. The benchmark's --sweep mutates these dicts.
GATHER_BF16 = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_N_SWIGLU": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
GATHER_CFG = {
    torch.bfloat16: GATHER_BF16,  # its own name: a benchmark's --set ...GATHER_BF16.BLOCK_N=64 changes it in place
    torch.float32: {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_N_SWIGLU": 32, "BLOCK_K": 32, "num_warps": 4,
                    "num_stages": 3},
}  # fmt: skip
GROUPED_CFG = {dtype: dict(cfg) for dtype, cfg in GATHER_CFG.items()}
# 4 stages: 5% faster than 3 at 4096 tokens (H200, --sweep; 3.84 against 4.03 ms). TMA tile loads and Triton's
# warp-specialised loop were measured there too (host descriptors, same bits): 3.76-3.84 ms, no gain worth a
# second kernel.
GROUPED_WIDE_CFG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_N_SWIGLU": 128, "BLOCK_K": 64, "num_warps": 8,
                    "num_stages": 4}  # fmt: skip
WIDE_MIN_ROWS_PER_EXPERT = 64


def _grouped_cfg(dtype: torch.dtype, rows: int, num_experts: int) -> dict:
    if dtype == torch.bfloat16 and rows >= WIDE_MIN_ROWS_PER_EXPERT * num_experts:
        return GROUPED_WIDE_CFG
    return GROUPED_CFG[dtype]


_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


def _launch(
    x, w, out, row_scale, tile_e, tile_r0, tile_r1, index, slots, gather, cfg, fuse_swiglu, swiglu_limit, row_div=1
):
    n_out, k = out.shape[1], x.shape[1]
    bn = cfg["BLOCK_N_SWIGLU"] if fuse_swiglu else cfg["BLOCK_N"]
    grid = (slots, triton.cdiv(n_out, bn)) if gather else (triton.cdiv(n_out, bn), slots)
    dummy = tile_e  # pointer for the arguments a layout does not read
    _grouped_kernel[grid](
        x, w, out, row_scale if row_scale is not None else dummy,
        tile_e, tile_r0 if tile_r0 is not None else dummy, tile_r1 if tile_r1 is not None else dummy,
        index if index is not None else dummy, n_out, k,
        float(swiglu_limit) if swiglu_limit is not None else 0.0, row_div,
        GATHER=gather, HAS_INDEX=index is not None, FUSE=fuse_swiglu, HAS_LIMIT=swiglu_limit is not None,
        HAS_RS=row_scale is not None, TERMS=_TERMS[x.dtype], IEEE=w.dtype == torch.float32 or interpreting(),
        EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(x.device),
    )  # fmt: skip


def expert_out(rows, w, fuse_swiglu, out_dtype, device):
    """The empty [rows, N] output of an expert GEMM over stacks ``w`` [E, N, ...] ([rows, N/2] with the fused
    SwiGLU); shared by the grouped GEMM backends (bf16 / FP8 and MXFP4, Triton and Gluon)."""
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    return torch.empty(rows, n_out, dtype=out_dtype, device=device)


def grouped_block_m(w: torch.Tensor, rows: int) -> int:
    """The contiguous layout's BLOCK_M for expert weights ``w`` [E, N, K] over ``rows`` sorted rows: callers that
    run two GEMMs over one sort build the tile list once (``expert_tile_schedule``) and pass it as ``schedule``."""
    return _grouped_cfg(w.dtype, rows, w.shape[0])["BLOCK_M"]


def grouped_gemm_triton(
    x, w, expert_offsets, *, fuse_swiglu=False, swiglu_limit=None, row_scale=None, out_dtype=torch.bfloat16,
    row_index=None, schedule=None,
):  # fmt: skip
    """Contiguous layout (see module docstring); with ``row_index`` the tiles read their rows of x in place.
    ``schedule``: ``expert_tile_schedule(expert_offsets, rows, grouped_block_m(w, rows))``, made already."""
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    out = expert_out(rows, w, fuse_swiglu, out_dtype, x.device)
    if rows == 0 or out.shape[1] == 0:
        return out
    if x.shape[1] == 0:  # every dot is 0, and so is silu(0) * 0
        return out.zero_()
    cfg = _grouped_cfg(w.dtype, rows, w.shape[0])
    tile_e, tile_r0, tile_r1, slots = schedule or expert_tile_schedule(expert_offsets, rows, cfg["BLOCK_M"])
    rs = row_scale.contiguous() if row_scale is not None else None
    idx = row_index.contiguous() if row_index is not None else None
    _launch(x.contiguous(), w.contiguous(), out, rs, tile_e, tile_r0, tile_r1, idx, slots, False, cfg,
            fuse_swiglu, swiglu_limit)  # fmt: skip
    return out


def grouped_gemm_gather_triton(
    x, w, row_expert, *, row_index=None, fuse_swiglu=False, swiglu_limit=None, row_scale=None, out_dtype=torch.bfloat16,
    rows_per_input=1,
):  # fmt: skip
    """Gathered layout (see module docstring). Without ``row_index``, row p reads input row p // rows_per_input
    (``rows_per_input`` = k: the (token, slot) pairs of token-major x, what ``row_index = arange(T * k) // k`` reads,
    without the two launches that make it)."""
    if rows_per_input < 1 or (row_index is not None and rows_per_input != 1):
        raise ValueError(f"grouped_gemm_gather_triton: rows_per_input {rows_per_input} needs >= 1 and no row_index")
    p = row_expert.shape[0]
    out = expert_out(p, w, fuse_swiglu, out_dtype, x.device)
    if p == 0 or out.shape[1] == 0:
        return out
    if x.shape[1] == 0:  # every dot is 0, and so is silu(0) * 0
        return out.zero_()
    idx = row_index.contiguous() if row_index is not None else None
    rs = row_scale.contiguous() if row_scale is not None else None
    _launch(x.contiguous(), w.contiguous(), out, rs, row_expert.contiguous(), None, None, idx, p, True,
            GATHER_CFG[w.dtype], fuse_swiglu, swiglu_limit, rows_per_input)  # fmt: skip
    return out


register_backend(
    "grouped_gemm", "triton", grouped_gemm_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
register_backend(
    "grouped_gemm_gather", "triton", grouped_gemm_gather_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

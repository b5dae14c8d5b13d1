"""Triton ``candidate_block_mask`` (CUDA backend ``triton``): V4.1's level-one pre-filter without the ~20 PyTorch
launches of the reference (about 28 us of V4.1's batch-1 decode step, on the chain before the re-index layers).

Rows are the [B * S] query rows, each of N scores; a block is ``block_size`` consecutive entries, BSP its width
padded to a power of two, and a program takes BLOCKS blocks of one row as a [BLOCKS, BSP] tile.

* Budget holds every block (``top_blocks >= n_blocks``: V4.1 up to 16K entries): a block is kept when it is the
  newest visible entry's block or holds a selectable score above -inf (visible, not NaN), exactly the reference's
  ``block score > -inf``; ``_candidate_blocks_kernel`` writes the kept blocks' visible positions in one launch.
* Otherwise the same kernel writes each block's score (max over its selectable entries, -inf if
  none, +inf for the newest block), ``topk_select`` keeps the top ``top_blocks`` of them (its ties: the lower block
  wins, one of the choices the contract leaves open; -inf blocks are never selected, as the reference's
  ``values > -inf``), and ``_candidate_expand_kernel`` writes the kept blocks' visible positions into a zeroed mask.

Boolean results and exact maxima: bitwise the reference (up to its unspecified ties), one row per program row,
hence batch-invariant.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from ..topk_select.triton import _row_length, topk_select_triton

ENTRIES_PER_PROGRAM = 2048  # a row's blocks per program: BLOCKS = this // BSP (V4.1: 256 blocks of 8)
PICKS_PER_PROGRAM = 64  # kept blocks a program of the expand kernel writes
NUM_WARPS = 4


@triton.jit
def _block_tile(scores_ptr, vis_ptr, row, N, n_blocks, s_stride, BS: tl.constexpr, BSP: tl.constexpr,
                BLOCKS: tl.constexpr):  # fmt: skip
    """This program's blocks of ``row``: (block ids [BLOCKS], positions [BLOCKS, BSP], in-row [BLOCKS, BSP],
    visible [BLOCKS, BSP], selectable scores with -inf elsewhere [BLOCKS, BSP], the newest block or -1)."""
    vis = _row_length(vis_ptr, row, N, True)  # visible, clamped to [0, N]
    newest = tl.where(vis > 0, (vis - 1) // BS, -1)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, BSP)[None, :]
    pos = blk[:, None] * BS + j
    inb = (j < BS) & (blk[:, None] < n_blocks) & (pos < N)
    seen = inb & (pos < vis)
    s = tl.load(scores_ptr + row * s_stride + pos, mask=seen, other=float("-inf"))
    s = tl.where(s == s, s, float("-inf"))  # NaN is not selectable
    return blk, pos, inb, seen, s, newest


@triton.jit
def _candidate_blocks_kernel(
    scores_ptr, vis_ptr, out_ptr, N, n_blocks, s_stride, BS: tl.constexpr, BSP: tl.constexpr,
    BLOCKS: tl.constexpr, ALL_FIT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """ALL_FIT: the mask of the kept blocks' visible positions (out: uint8 [rows, N]); else each block's score
    (out: fp32 [rows, n_blocks]; -inf with nothing selectable, +inf for the newest block)."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk, pos, inb, seen, s, newest = _block_tile(scores_ptr, vis_ptr, row, N, n_blocks, s_stride, BS, BSP, BLOCKS)
    if ALL_FIT:  # kept = the reference's block score > -inf
        keep = (tl.max(tl.where(s > float("-inf"), 1, 0), axis=1) > 0) | (blk == newest)
        tl.store(out_ptr + row * N + pos, (keep[:, None] & seen).to(tl.uint8), mask=inb)
    else:
        best = tl.where(blk == newest, float("inf"), tl.max(s, axis=1))
        tl.store(out_ptr + row * n_blocks + blk, best, mask=blk < n_blocks)


@triton.jit
def _candidate_expand_kernel(
    picks_ptr, vis_ptr, out_ptr, N, width, BS: tl.constexpr, BSP: tl.constexpr, PICKS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Kept blocks (``topk_select``'s picks, -1 padded) -> their visible positions set in the zeroed mask."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    vis = _row_length(vis_ptr, row, N, True)
    i = tl.program_id(1) * PICKS + tl.arange(0, PICKS)
    blk = tl.load(picks_ptr + row * width + i, mask=i < width, other=-1)
    pos = blk[:, None] * BS + tl.arange(0, BSP)[None, :]
    ok = (blk[:, None] >= 0) & (tl.arange(0, BSP)[None, :] < BS) & (pos < vis)
    tl.store(out_ptr + row * N + pos, tl.full(pos.shape, 1, tl.uint8), mask=ok)


def candidate_block_mask_triton(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, top_blocks: int
) -> torch.Tensor:
    """The op (contract in ``__init__.py``)."""
    require_same_device(scores, visible)
    b, s, n = scores.shape
    rows = b * s
    out = torch.empty(rows, n, dtype=torch.uint8, device=scores.device)
    if out.numel() == 0:
        return out.view(torch.bool).view(b, s, n)
    flat = scores.reshape(rows, n)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    vis = visible.reshape(rows).to(torch.int64).contiguous()
    n_blocks = triton.cdiv(n, block_size)
    bsp = triton.next_power_of_2(block_size)
    blocks = max(1, min(triton.next_power_of_2(n_blocks), ENTRIES_PER_PROGRAM // bsp))
    grid = (rows, triton.cdiv(n_blocks, blocks))
    meta = dict(BS=block_size, BSP=bsp, BLOCKS=blocks, num_warps=NUM_WARPS, **pdl_options(scores.device))
    if top_blocks >= n_blocks:
        _candidate_blocks_kernel[grid](flat, vis, out, n, n_blocks, flat.stride(0), ALL_FIT=True, **meta)
        return out.view(torch.bool).view(b, s, n)
    block_scores = torch.empty(rows, n_blocks, dtype=torch.float32, device=scores.device)
    _candidate_blocks_kernel[grid](flat, vis, block_scores, n, n_blocks, flat.stride(0), ALL_FIT=False, **meta)
    picks = topk_select_triton(block_scores, top_blocks)
    out.zero_()
    width = picks.shape[1]
    _candidate_expand_kernel[(rows, triton.cdiv(width, PICKS_PER_PROGRAM))](
        picks, vis, out, n, width, BS=block_size, BSP=bsp, PICKS=PICKS_PER_PROGRAM, num_warps=NUM_WARPS,
        **pdl_options(scores.device),
    )  # fmt: skip
    return out.view(torch.bool).view(b, s, n)


register_backend(
    "candidate_block_mask", "triton", candidate_block_mask_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

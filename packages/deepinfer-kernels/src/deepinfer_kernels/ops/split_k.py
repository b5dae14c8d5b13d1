"""What the split-K GEMM kernels share (``fp8_gemm``, ``linear``, ``grouped_linear``): the SM count their K splits
are sized for, the fp32 workspace of the partial products and their fixed-order sum (part of what keeps them
batch-invariant)."""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options

SMS = 132  # H200; only sets how far decode-size GEMMs are split along K


@triton.jit
def split_sum_kernel(ws_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """c = ws[0] + ws[1] + ... + ws[SPLIT-1], added in that order (fixed: batch-invariant), then cast."""
    pdl_prologue(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def k_split(tiles: int, steps: int, *, programs_per_sm: int, min_steps: int, max_split: int) -> int:
    """The K split (a power of two) of a GEMM of ``tiles`` output tiles and ``steps`` K steps: doubled while the
    programs stay within ~``programs_per_sm`` an SM, each split keeps at least ``min_steps`` steps, and at most
    ``max_split``. From the shape only (never M), so a batch-invariant kernel stays so."""
    split = 1
    while split < max_split and tiles * split * 2 <= programs_per_sm * SMS and steps // (split * 2) >= min_steps:
        split *= 2
    return split


def split_workspace(c: torch.Tensor, split: int) -> torch.Tensor:
    """Where a GEMM split ``split`` ways along K writes: ``c`` itself when unsplit, else an fp32 [split, *c.shape]
    workspace for ``sum_splits``."""
    return c if split == 1 else torch.empty(split, *c.shape, dtype=torch.float32, device=c.device)


def sum_splits(ws: torch.Tensor, c: torch.Tensor, split: int) -> None:
    """c = the splits of ``ws`` added in order (``split_sum_kernel``); nothing when unsplit (``ws`` is ``c``)."""
    if split > 1:
        mn = c.numel()
        split_sum_kernel[(triton.cdiv(mn, 1024),)](
            ws, c, mn, SPLIT=split, BLOCK=1024, num_warps=4, **pdl_options(ws.device)
        )

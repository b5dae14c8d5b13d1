"""What the split-K GEMM kernels share (``fp8_gemm``, ``linear``): the SM count their K splits are sized for,
and the fixed-order sum of the partial products (part of what keeps them batch-invariant)."""

import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue

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

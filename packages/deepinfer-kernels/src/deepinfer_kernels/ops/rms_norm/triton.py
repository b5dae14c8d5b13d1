"""Triton RMSNorm: one row per program, fp32 statistics (CUDA backend ``triton``).

Layout: x is viewed as [R, D] rows with a contiguous last dim (``reshape``; a copy only when x is not
already row-contiguous); weight is [D] or None. The sum of squares of a row is accumulated in a
[BLOCK] fp32 vector over fixed chunks of the row and reduced once by ``tl.sum``: BLOCK and num_warps
depend on D only, so a row's reduction order (and bits) never depends on how many rows are in the
call. Batch-invariant by construction. The order differs from the reference's pairwise tree, so
results match it to ~1 ulp of fp32 statistics, not bitwise.

Importing this module registers the backend; it needs triton (the op's ``__init__`` guards the import).
CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1 (tests only; registered for "cuda").
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

MAX_BLOCK = 8192  # widest chunk held in registers; V4/V4.1 rows (512..7168) fit in one chunk


@triton.jit
def inv_rms(sum_sq, D, eps):
    """1 / sqrt(mean square + eps) from a row's fp32 sum of squares (every RMSNorm kernel's statistic)."""
    return 1.0 / tl.sqrt(sum_sq / D + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, D, x_stride, y_stride, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        m = start + cols < D
        xv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        acc += xv * xv
    inv = inv_rms(tl.sum(acc, axis=0), D, eps)
    for start in range(0, D, BLOCK):
        m = start + cols < D
        yv = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32) * inv
        if HAS_WEIGHT:
            yv = yv * tl.load(w_ptr + start + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, yv.to(y_ptr.dtype.element_ty), mask=m)


def norm_config(d: int) -> tuple[int, int]:
    """(BLOCK, num_warps) from D alone (the invariance argument above depends on this)."""
    block = min(triton.next_power_of_2(max(d, 1)), MAX_BLOCK)
    return block, max(1, min(16, block // 256))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    require_same_device(x, *([weight] if weight is not None else []))
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y.view(x.shape)
    block, warps = norm_config(d)
    w = weight if weight is not None else x2  # dummy pointer when unweighted (never read)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, w.contiguous(), y, d, x2.stride(0), y.stride(0), float(eps),
        HAS_WEIGHT=weight is not None, BLOCK=block, num_warps=warps, **pdl_options(x2.device),
    )  # fmt: skip
    return y.view(x.shape)


register_backend(
    "rms_norm", "triton", rms_norm_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

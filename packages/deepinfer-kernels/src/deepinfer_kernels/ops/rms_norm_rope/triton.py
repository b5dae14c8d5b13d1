"""Triton rms_norm_rope: one program per (token, head) row, the norm and the rotation in registers (CUDA backend
``triton``).

Bit-identical to the Triton ``rms_norm`` followed by the Triton ``rope_interleaved`` (the GPU tests check it at the
V4 / V4.1 call sites), so a model may fuse or not without changing its logits:

* the statistics load the row as ``rms_norm``'s kernel does (the same [BLOCK] vector with the same warps, hence
  the same order of the sum of squares; the same ``inv_rms``), and scale and weight it in the same order;
* the normed row is rounded to x.dtype, as ``rms_norm`` stores it, before the rotation reads it;
* the rotation is ``rope_interleaved``'s (its ``rope_cos_sin`` of one fp32 product and ``rotate_pairs``, no FMA
  contraction, no flush to zero), on the trailing R channels loaded again as adjacent pairs (cos / sin for those
  R / 2 pairs only); the leading D - R channels are stored from the statistics' vector.

With ``out`` / ``out_rows`` each program stores its row at the table row the plan gives (a masked store where
that row is negative), so a decode step's latents reach their cache table without a scatter launch.

Rows wider than rms_norm's widest single chunk (MAX_BLOCK) run the two ops. A row's arithmetic depends on its own
values, position and D only: batch-invariant. CPU tensors run in Triton's interpreter when TRITON_INTERPRET=1
(tests only; the interpreter has no libdevice, as in ``rope_interleaved``).
"""

import math

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import interpreting, pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.ops.rms_norm import rms_norm
from deepinfer_kernels.ops.rms_norm.triton import MAX_BLOCK, inv_rms, norm_config
from deepinfer_kernels.ops.rms_norm_rope.reference import store_rows
from deepinfer_kernels.ops.rope import rope_interleaved
from deepinfer_kernels.ops.rope.triton import rope_cos_sin, rotate_pairs
from deepinfer_kernels.registry import register_backend


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, pos_ptr, freq_ptr, y_ptr, rows_ptr,
    H, D, NOPE, HALF, x_stride_t, x_stride_h, y_stride_t, y_stride_h, rows_stride, eps,
    HAS_WEIGHT: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    h = row % H
    x_row = x_ptr + t * x_stride_t + h * x_stride_h
    if HAS_ROWS:  # row t of the result goes to row rows[t] of the table y (none where negative)
        dst = tl.load(rows_ptr + t * rows_stride).to(tl.int64)
        keep = dst >= 0
        y_row = y_ptr + tl.maximum(dst, 0) * y_stride_t + h * y_stride_h
    else:
        keep = True
        y_row = y_ptr + t * y_stride_t + h * y_stride_h

    # the statistics as rms_norm's kernel takes them: one [BLOCK] vector, the same sum order
    cols = tl.arange(0, BLOCK)
    xv = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc += xv * xv
    inv = inv_rms(tl.sum(acc, axis=0), D, eps)

    # the leading D - R channels: the norm's output as it stands
    yv = xv * inv
    if HAS_WEIGHT:
        yv = yv * tl.load(w_ptr + cols, mask=cols < NOPE, other=0.0).to(tl.float32)
    tl.store(y_row + cols, yv.to(y_ptr.dtype.element_ty), mask=(cols < NOPE) & keep)

    # the trailing R channels as adjacent pairs: normed and rounded to the output dtype as rms_norm stores them,
    # then rope_interleaved's rotation (a, b) -> (a cos - b sin, b cos + a sin)
    p = tl.arange(0, BLOCK_HALF)
    c2 = NOPE + 2 * p[:, None] + tl.arange(0, 2)[None, :]
    m2 = (p < HALF)[:, None]
    v = tl.load(x_row + c2, mask=m2, other=0.0).to(tl.float32) * inv
    if HAS_WEIGHT:
        v = v * tl.load(w_ptr + c2, mask=m2, other=0.0).to(tl.float32)
    v = v.to(y_ptr.dtype.element_ty).to(tl.float32)
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + p, mask=p < HALF, other=0.0)
    cos, sin = rope_cos_sin(angle, LIBDEVICE)
    a, b = tl.split(v)
    tl.store(y_row + c2, rotate_pairs(a, b, cos, sin).to(y_ptr.dtype.element_ty), mask=m2 & keep)


def rms_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    t, d, half = x.shape[0], x.shape[-1], inv_freq.shape[0]
    if d > MAX_BLOCK or half == 0:  # wider rows: rms_norm sums them in chunks (another order); no rotation at all
        y = rope_interleaved(rms_norm(x, weight, eps), positions, inv_freq)
        return y if out is None else store_rows(out, y, out_rows)
    freq = inv_freq.to(device=x.device, dtype=torch.float32).contiguous()
    require_same_device(x, positions, freq, *([weight] if weight is not None else []))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    h = math.prod(x.shape[1:-1])
    if x.numel() == 0:
        return y
    x3 = x.reshape(t, h, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y3 = y.view(y.shape[0], h, d)
    block, warps = norm_config(d)
    w = weight.contiguous() if weight is not None else x3  # dummy pointer when unweighted (never read)
    rows = out_rows if out_rows is not None else positions  # (a dummy pointer without out_rows; read in place:
    # a column of a row table, strided, costs no copy)
    _rms_norm_rope_kernel[(t * h,)](
        x3, w, positions.contiguous(), freq, y3, rows, h, d, d - 2 * half, half,
        x3.stride(0), x3.stride(1), y3.stride(0), y3.stride(1), rows.stride(0), float(eps),
        HAS_WEIGHT=weight is not None, HAS_ROWS=out_rows is not None, BLOCK=block,
        BLOCK_HALF=triton.next_power_of_2(half), LIBDEVICE=not interpreting(), num_warps=warps,
        enable_fp_fusion=False, enable_reflect_ftz=False, **pdl_options(x3.device),
    )  # fmt: skip
    return y


register_backend(
    "rms_norm_rope", "triton", rms_norm_rope_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

"""Plain-PyTorch MXFP4 expert GEMMs (the definition of correct): per expert, dequantise with the quant
reference, multiply with the row-invariant ``linear_ref`` in fp32, then ``swiglu_clamp`` and the row scale
in fp32, cast once. Only experts that own rows are dequantised."""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.ops.moe.reference import swiglu_clamp_ref
from deepinfer_kernels.ops.quant.reference import mxfp4_dequantize_ref
from deepinfer_kernels.registry import register_reference


def _epilogue(y, fuse_swiglu, swiglu_limit, row_scale):
    if fuse_swiglu:
        half = y.shape[1] // 2
        y = swiglu_clamp_ref(y[:, :half], y[:, half:], swiglu_limit)
    if row_scale is not None:
        y = y * row_scale.float().unsqueeze(-1)
    return y


def _expert_rows(x32, w, w_scale, e, rows, fuse_swiglu, swiglu_limit, row_scale):
    we = mxfp4_dequantize_ref(w[e], w_scale[e], torch.float32)
    rs = None if row_scale is None else row_scale[rows]
    return _epilogue(linear_ref(x32[rows], we), fuse_swiglu, swiglu_limit, rs)


@register_reference("mxfp4_grouped_gemm")
def mxfp4_grouped_gemm_ref(
    x, w, w_scale, expert_offsets, *, row_index=None, fuse_swiglu=False, swiglu_limit=None, row_scale=None,
    out_dtype=torch.bfloat16,
):  # fmt: skip
    if row_index is not None:
        x = x.index_select(0, row_index.long())
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    out = torch.zeros(x.shape[0], n_out, dtype=torch.float32, device=x.device)
    x32 = x.float()
    offs = expert_offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            rows = torch.arange(lo, hi, device=x.device)
            out[lo:hi] = _expert_rows(x32, w, w_scale, e, rows, fuse_swiglu, swiglu_limit, row_scale)
    return out.to(out_dtype)


@register_reference("mxfp4_grouped_gemm_gather")
def mxfp4_grouped_gemm_gather_ref(
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
    p = row_expert.shape[0]
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    out = torch.zeros(p, n_out, dtype=torch.float32, device=x.device)
    x32 = (x.repeat_interleave(rows_per_input, 0) if row_index is None else x[row_index.long()]).float()
    ids = row_expert.long()
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = _expert_rows(x32, w, w_scale, e, rows, fuse_swiglu, swiglu_limit, row_scale)
    return out.to(out_dtype)

"""Plain-PyTorch dense expert GEMMs (the definition of correct): per expert that owns rows, upcast its weight
to fp32, multiply with the row-invariant ``linear_ref``, then ``swiglu_clamp`` and the row scale in fp32,
cast once. The same arithmetic as ``moe_experts_ref``'s projections."""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.ops.moe.reference import swiglu_clamp_ref
from deepinfer_kernels.registry import register_reference


def _expert_rows(x32, w, e, rows, fuse_swiglu, swiglu_limit, row_scale):
    y = linear_ref(x32[rows], w[e].float())
    if fuse_swiglu:
        half = y.shape[1] // 2
        y = swiglu_clamp_ref(y[:, :half], y[:, half:], swiglu_limit)
    if row_scale is not None:
        y = y * row_scale[rows].float().unsqueeze(-1)
    return y


@register_reference("grouped_gemm")
def grouped_gemm_ref(
    x,
    w,
    expert_offsets,
    *,
    fuse_swiglu=False,
    swiglu_limit=None,
    row_scale=None,
    out_dtype=torch.bfloat16,
    row_index=None,
):
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    x32 = (x if row_index is None else x[row_index.long()]).float()
    out = torch.zeros(x32.shape[0], n_out, dtype=torch.float32, device=x.device)
    offs = expert_offsets.tolist()
    for e in range(w.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = _expert_rows(x32, w, e, slice(lo, hi), fuse_swiglu, swiglu_limit, row_scale)
    return out.to(out_dtype)


@register_reference("grouped_gemm_gather")
def grouped_gemm_gather_ref(
    x, w, row_expert, *, row_index=None, fuse_swiglu=False, swiglu_limit=None, row_scale=None, out_dtype=torch.bfloat16
):
    n_out = w.shape[1] // 2 if fuse_swiglu else w.shape[1]
    out = torch.zeros(row_expert.shape[0], n_out, dtype=torch.float32, device=x.device)
    x32 = (x if row_index is None else x[row_index.long()]).float()
    ids = row_expert.long()
    for e in torch.unique(ids).tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = _expert_rows(x32, w, e, rows, fuse_swiglu, swiglu_limit, row_scale)
    return out.to(out_dtype)

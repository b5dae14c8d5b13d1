"""The cuBLAS backend of ``linear``: the fast path on CUDA outside batch-invariant mode.

The reference keeps rows independent by computing 16-row tiles one ``F.linear`` at a time, which on a GPU means
M / 16 launches per projection (512 for an 8K-token prefill). One ``F.linear`` call does the same product in one
GEMM, but cuBLAS picks its kernel, blocking and split-K from the whole shape, so a row's bits change with M: not
batch-invariant (``triton.py``'s ``triton_fixed`` serves that mode).
"""

import torch
import torch.nn.functional as F

from deepinfer_kernels.registry import register_backend


def linear_cublas(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``linear`` as one cuBLAS GEMM (fp32 inputs stay fp32 unless torch's TF32 switch is on). With ``out_dtype``
    (bf16 / fp16 x and weight of one dtype): one tensor-core GEMM accumulating and writing fp32 (``mm.dtype``)."""
    if out_dtype is None:
        return F.linear(x, weight.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1])
    return torch.mm(rows, weight.t(), out_dtype=out_dtype).reshape(*x.shape[:-1], weight.shape[0])


register_backend("linear", "cublas", linear_cublas, devices=("cuda",), priority=20, available=torch.cuda.is_available)

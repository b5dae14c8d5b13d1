"""The cuBLAS backend of ``linear``: the fast path on CUDA outside batch-invariant mode.

The reference keeps rows independent by computing 16-row tiles one ``F.linear`` at a time, which on a GPU means
M / 16 launches per projection (512 for an 8K-token prefill). One ``F.linear`` call does the same product in one
GEMM, but cuBLAS picks its kernel, blocking and split-K from the whole shape, so a row's bits change with M: not
batch-invariant (``triton.py``'s ``triton_fixed`` serves that mode).
"""

import torch
import torch.nn.functional as F

from deepinfer_kernels.registry import register_backend


def linear_cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear`` as one cuBLAS GEMM (fp32 inputs stay fp32 unless torch's TF32 switch is on)."""
    return F.linear(x, weight.to(x.dtype))


register_backend("linear", "cublas", linear_cublas, devices=("cuda",), priority=20, available=torch.cuda.is_available)

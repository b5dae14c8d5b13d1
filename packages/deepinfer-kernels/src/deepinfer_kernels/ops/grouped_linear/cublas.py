"""The cuBLAS backend of ``grouped_linear``: the fast path on CUDA outside batch-invariant mode.

The reference runs one row-invariant ``linear_ref`` per group, that is G x ceil(T / 16) ``F.linear`` launches
(8 for one decode token, 2048 for a 4096-token prefill). One strided batched GEMM does the same products in
one launch: ``torch.bmm`` on the group-major views x[:, g] ([T, Din], row stride G * Din) and W_g^T, written
straight into y[:, g] (no transposed copies; cuBLAS takes the row strides as leading dimensions). fp32
accumulation for bf16 / fp16 as in any cuBLAS GEMM; fp32 inputs stay fp32 unless torch's TF32 switch is on.
cuBLAS picks its kernel, blocking and split-K from the whole shape, so a row's bits change with T: not
batch-invariant (``triton.py``'s ``triton_fixed`` serves that mode).
"""

import torch

from deepinfer_kernels.registry import register_backend


def grouped_linear_cublas(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grouped_linear`` as one batched cuBLAS GEMM over the G groups."""
    t, g, k = x.shape
    w = weight.to(x.dtype).view(g, weight.shape[0] // g, k)  # [G, Dout, Din]
    y = torch.empty(t, g, w.shape[1], dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
    return y


register_backend(
    "grouped_linear", "cublas", grouped_linear_cublas, devices=("cuda",), priority=20,
    available=torch.cuda.is_available,
)  # fmt: skip

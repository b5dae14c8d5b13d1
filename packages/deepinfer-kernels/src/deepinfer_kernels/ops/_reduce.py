"""Row-invariant reductions over the last dim, shared by the references.

``x.sum(-1)`` / ``mean`` / ``softmax`` pick their reduction strategy from the tensor's shape on CUDA (and,
for long rows, on the CPU), so a row's bits can change with the number of rows. A sum computed as the
tiled matrix product with a ones vector (``linear_ref``) does not: every row is reduced by the same
fixed-shape kernel whatever else is in the call.
"""

import torch

from deepinfer_kernels.ops.linear.reference import linear_ref


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., 1]: the sum of each row, in x.dtype, row-invariant."""
    return linear_ref(x, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., 1]: row_sum / K."""
    return row_sum(x) / x.shape[-1]


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with a row-invariant denominator (max is exact in any order)."""
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / row_sum(e)

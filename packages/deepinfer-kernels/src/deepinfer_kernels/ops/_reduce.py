"""Row-invariant reductions over the last dim, shared by the references.

``x.sum(-1)`` / ``mean`` / ``softmax`` pick their reduction strategy from the tensor's shape on CUDA (and,
for long rows, on the CPU), so a row's bits can change with the number of rows. ``row_sum`` instead adds
in a fixed pairwise tree made of elementwise additions (zero-padded to a power of two), which every
device evaluates identically for every row, whatever else is in the call.
"""

import torch
import torch.nn.functional as F


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., 1]: the sum of each row, in x.dtype, by a fixed pairwise tree (row-invariant)."""
    k = x.shape[-1]
    width = 1 << max(k - 1, 0).bit_length()
    if width != k:
        x = F.pad(x, (0, width - k))  # adding exact zeros changes no partial sum
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., 1]: row_sum / K."""
    return row_sum(x) / x.shape[-1]


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with a row-invariant denominator (max is exact in any order)."""
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / row_sum(e)

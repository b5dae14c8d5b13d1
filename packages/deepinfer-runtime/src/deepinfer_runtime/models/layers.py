"""Weight holders shared by the DeepSeek V4 and V4.1 models: parameters live under the checkpoint's
names, and every matrix product goes through the row-invariant ``deepinfer_kernels.linear``."""

from __future__ import annotations

import torch
from deepinfer_kernels import linear, rms_norm
from torch import nn


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Holds ``weight`` [out, in] under the checkpoint's name; y = x W^T in x's dtype, row-invariant."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def cat_rows(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=0)


class Experts(nn.Module):
    """Routed experts stacked per layer: ``w13`` [E, 2I, d] (gate rows then up rows) and ``w2`` [E, d, I]."""

    def __init__(self, n_experts: int, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w13 = param(n_experts, 2 * inter, hidden, dtype=dtype)
        self.w2 = param(n_experts, hidden, inter, dtype=dtype)


class SharedExpert(nn.Module):
    def __init__(self, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            Linear(hidden, inter, dtype),
            Linear(hidden, inter, dtype),
            Linear(inter, hidden, dtype),
        )

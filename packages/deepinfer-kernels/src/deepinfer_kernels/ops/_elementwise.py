"""Row-invariant elementwise activations for the references (fp32 on the CPU).

ATen's CPU kernels for ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` evaluate the elements of a
full SIMD block with a vector formula and the leftover tail with a different scalar formula, so one
element's bits depend on where it falls in the flattened tensor, i.e. on how many other rows are in
the call. ``exp``, ``log1p`` and exactly rounded arithmetic (+ - * /, sqrt) agree bit for bit
between the two paths, so these spell the activations with those alone (the scalar formulas
of ATen; within 1-2 ulp of the vectorised ones).
"""

import torch

SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default: above it softplus(x) = x


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), row-invariant (``torch.sigmoid`` is not on the CPU)."""
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)), row-invariant (``F.silu`` is not on the CPU)."""
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x above the threshold; row-invariant (``F.softplus`` is not on the CPU)."""
    return torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x)))

"""GPU backend of ``swiglu_mlp`` (the shared expert) for 16-bit weights: three ``linear`` GEMMs in the weights'
dtype instead of the reference's fp32 copies of every weight on every call.

gate and up come out of the GEMMs in fp32 (16-bit x 16-bit products are exact in fp32, accumulated in fp32 as
the reference does, in another order); the clamped SwiGLU runs in fp32 as the reference; its result is rounded
to the weights' dtype for the down projection (as transformers' V4 MLP does), which is where this backend
differs from the reference most: about 2^-9 relative per element of the hidden state.

Batch-invariant exactly when ``linear`` is: it dispatches ``linear`` and ``linear_many`` (gate and up in one
launch at decode sizes), which in batch-invariant mode admit only row-invariant GEMMs; registered
``batch_invariant=True``.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.linear import linear
from deepinfer_kernels.ops.linear_many import linear_many
from deepinfer_kernels.registry import register_backend

from .reference import swiglu_clamp_ref, swiglu_mlp_ref

_HALF = (torch.bfloat16, torch.float16)


def swiglu_mlp_gemms(x, w1, w3, w2, swiglu_limit: float | None, act) -> torch.Tensor:
    """gate / up GEMMs writing fp32, ``act(gate, up, limit)`` -> the hidden rows in x.dtype, the down GEMM; the
    reference when x or a weight is not 16-bit (or the dtypes differ)."""
    if x.dtype not in _HALF or any(w.dtype != x.dtype for w in (w1, w3, w2)):
        return swiglu_mlp_ref(x, w1, w3, w2, swiglu_limit=swiglu_limit)
    gate, up = linear_many(x, [w1, w3], [torch.float32, torch.float32])  # one launch at decode sizes
    return linear(act(gate, up, swiglu_limit), w2)


def swiglu_mlp_linear(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float | None
) -> torch.Tensor:
    return swiglu_mlp_gemms(x, w1, w3, w2, swiglu_limit, lambda g, u, limit: swiglu_clamp_ref(g, u, limit).to(x.dtype))


register_backend(
    "swiglu_mlp", "linear", swiglu_mlp_linear, devices=("cuda",), priority=20, batch_invariant=True,
)  # fmt: skip

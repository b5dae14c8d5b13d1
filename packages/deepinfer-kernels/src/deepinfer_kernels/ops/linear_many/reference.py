"""``linear_many`` as one ``linear`` per weight: the reference (``linear_ref``, the definition of correct) and the
``loop`` backend (the dispatching ``linear`` per weight: whatever ``linear`` runs, batch-invariant exactly when it
is, so it serves batch-invariant mode and every call the one-launch backend does not take)."""

import torch

from deepinfer_kernels.ops.linear import linear
from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.registry import register_backend, register_reference


def _one(fn, x: torch.Tensor, w: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor:
    # linear's own normalisation: an fp32 x computes in fp32 anyway; mixed 16-bit dtypes upcast both (exact)
    if dt is None or x.dtype == torch.float32:
        return fn(x, w)
    if w.dtype != x.dtype:
        return fn(x.float(), w.float())
    return fn(x, w, out_dtype=dt)


@register_reference("linear_many")
def linear_many_ref(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> list[torch.Tensor]:
    return [_one(linear_ref, x, w, dt) for w, dt in zip(weights, out_dtypes)]


def linear_many_loop(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> list[torch.Tensor]:
    return [linear(x, w, dt) for w, dt in zip(weights, out_dtypes)]


register_backend(
    "linear_many", "loop", linear_many_loop, devices=("cuda", "npu"), priority=10, batch_invariant=True,
)  # fmt: skip

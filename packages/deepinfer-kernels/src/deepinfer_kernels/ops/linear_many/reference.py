"""``linear_many`` as one ``linear`` per weight: the reference (``linear_ref``, the definition of correct) and the
``loop`` backend (the dispatching ``linear`` per weight: whatever ``linear`` runs, batch-invariant exactly when it
is, so it serves batch-invariant mode and every call the one-launch backend does not take)."""

import torch

from deepinfer_kernels.ops.linear import backend_args, linear
from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.registry import register_backend, register_reference


@register_reference("linear_many")
def linear_many_ref(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> list[torch.Tensor]:
    return [linear_ref(*backend_args(x, w, dt)) for w, dt in zip(weights, out_dtypes)]


def linear_many_loop(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> list[torch.Tensor]:
    return [linear(x, w, dt) for w, dt in zip(weights, out_dtypes)]


register_backend(
    "linear_many", "loop", linear_many_loop, devices=("cuda", "npu"), priority=10, batch_invariant=True,
)  # fmt: skip

"""Plain-PyTorch rms_norm_rope (the definition of correct): the two references, one after the other."""

import torch

from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref
from deepinfer_kernels.ops.rope.reference import rope_interleaved_ref
from deepinfer_kernels.registry import register_reference


@register_reference("rms_norm_rope")
def rms_norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    return rope_interleaved_ref(rms_norm_ref(x, weight, eps), positions, inv_freq)

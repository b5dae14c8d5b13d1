"""Plain-PyTorch rms_norm_rope (the definition of correct): the two references, one after the other."""

import torch

from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref
from deepinfer_kernels.ops.rope.reference import rope_interleaved_ref
from deepinfer_kernels.registry import register_reference


@register_reference("rms_norm_rope")
def rms_norm_rope_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    y = rope_interleaved_ref(rms_norm_ref(x, weight, eps), positions, inv_freq)
    return y if out is None else store_rows(out, y, out_rows)


def store_rows(out: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """out[rows[t]] = y[t] where rows[t] >= 0; returns out."""
    keep = rows >= 0
    out[rows[keep].long()] = y[keep]
    return out

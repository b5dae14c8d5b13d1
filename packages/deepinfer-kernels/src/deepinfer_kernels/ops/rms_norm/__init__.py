"""RMSNorm over the last dimension, weighted or unweighted."""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight.

    Args:
        x: [..., D], any float dtype; statistics are computed in fp32.
        weight: [D] (any float dtype, applied in fp32) or None for the unweighted norm.
        eps: added to the mean square (DeepSeek V4: 1e-6; V4.1: 1e-20, so an all-zero row stays 0).

    Returns:
        [..., D] in x.dtype. Empty inputs give empty outputs. See reference.py.
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != last dim of x {x.shape[-1]}")
    return dispatch("rms_norm", x.device, x, weight, eps)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

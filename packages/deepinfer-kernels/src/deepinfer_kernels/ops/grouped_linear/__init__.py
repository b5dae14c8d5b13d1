"""Grouped (block-diagonal) linear: DeepSeek V4's grouped output projection ``wo_a``."""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y[t, g] = W_g x[t, g], with W = weight.view(G, Dout, Din).

    Args:
        x: [T, G, Din] (for V4: the 64 heads x 512 output regrouped as 8 groups of 4096).
        weight: [G * Dout, Din], group-major rows (checkpoint ``wo_a``), cast to x.dtype.

    Returns:
        [T, G, Dout] in x.dtype. See reference.py.
    """
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[1] != x.shape[2] or weight.shape[0] % x.shape[1]:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    return dispatch("grouped_linear", x.device, x, weight)


from . import cublas as _cublas  # noqa: E402,F401  (registers the CUDA backend)

try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: E402,F401
except ImportError:
    pass

"""Plain-PyTorch block-diagonal grouped linear (the definition of correct)."""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("grouped_linear")
def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    g = x.shape[-2]
    w = weight.view(g, -1, x.shape[-1]).to(x.dtype)  # [G, Dout, Din]
    return torch.einsum("tgi,goi->tgo", x, w)

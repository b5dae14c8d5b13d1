"""Plain-PyTorch block-diagonal grouped linear (the definition of correct).

One row-invariant ``linear_ref`` per group (an einsum over groups would batch over G and fold
the tokens into M, so a token's bits would change with the number of tokens).
"""

import torch

from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.registry import register_reference


@register_reference("grouped_linear")
def grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    g = x.shape[-2]
    w = weight.view(g, -1, x.shape[-1]).to(x.dtype)  # [G, Dout, Din]
    return torch.stack([linear_ref(x[:, i], w[i]) for i in range(g)], dim=1)

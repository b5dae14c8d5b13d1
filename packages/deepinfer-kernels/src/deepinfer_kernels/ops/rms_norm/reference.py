"""Plain-PyTorch RMSNorm (the definition of correct)."""

import torch

from deepinfer_kernels.ops._reduce import row_mean
from deepinfer_kernels.registry import register_reference


@register_reference("rms_norm")
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # fp32 statistics; the weight multiplies in fp32 and the result is cast once (DeepSeek keeps
    # norm weights in fp32, so a bf16 multiply would round twice).
    xf = x.float()
    y = xf * torch.rsqrt(row_mean(xf.square()) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)

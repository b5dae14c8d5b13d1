"""The reference of ``l2_prefetch``: nothing to do (a cache hint changes no value)."""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("l2_prefetch")
def l2_prefetch_ref(t: torch.Tensor, max_bytes: int, period: int) -> None:
    return None

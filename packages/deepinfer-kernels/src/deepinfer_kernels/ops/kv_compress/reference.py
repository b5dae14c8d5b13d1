"""Plain-PyTorch KV compression pooling (the definition of correct)."""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("kv_compress_pool")
def kv_compress_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(score.float(), dim=-2)
    return (kv.float() * weights).sum(dim=-2).to(kv.dtype)

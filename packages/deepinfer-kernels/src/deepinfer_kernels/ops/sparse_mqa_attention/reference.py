"""Plain-PyTorch sparse multi-query attention with sinks (the definition of correct)."""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("sparse_mqa_attention")
def sparse_mqa_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    valid = indices >= 0  # [T, K]
    keys = kv[indices.clamp(min=0)].float()  # [T, K, D]; K = V
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    # the sink joins the max and the denominator but has no value: a fully masked row gives 0
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)

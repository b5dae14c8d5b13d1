"""Plain-PyTorch manifold-constrained hyper-connections (the definition of correct).

Everything that produces a coefficient runs in fp32; the collapse and expand contractions
accumulate in fp32 and cast to the stream dtype once. The operation order follows
transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` so fp32 results agree to
rounding (unweighted RMSNorm of the flattened streams, then the linear map).

Row-invariant in fp32 on the CPU: every token's coefficients depend only on that token (the
linear map is the tiled ``linear_ref``, the sigmoid the row-invariant one of ``_elementwise``;
the rest is per-token elementwise work, reductions over one token's own values, and ``matmul``
batched over tokens with a fixed per-token shape).
"""

import torch

from deepinfer_kernels.ops._elementwise import sigmoid
from deepinfer_kernels.ops._reduce import row_mean
from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref
from deepinfer_kernels.registry import register_reference


def _normed_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """[T, n, d] -> fp32 [T, rows(fn)]: unweighted RMSNorm over the flattened n*d, then @ fn^T."""
    flat = x.reshape(x.shape[0], x.shape[1] * x.shape[2]).float()
    flat = flat * torch.rsqrt(row_mean(flat.square()) + norm_eps)
    return linear_ref(flat, fn.float())


@register_reference("mhc_coefficients")
def mhc_coefficients_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[1]
    mixes = _normed_mixes(x, fn, norm_eps)
    m_pre, m_post, m_comb = mixes.split([n, n, n * n], dim=-1)
    base = base.float()
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)

    pre = sigmoid(m_pre * s_pre + b_pre) + hc_eps
    post = 2 * sigmoid(m_post * s_post + b_post)

    # comb logits L[t, j, k] = m_comb[t, j*n + k] * s + b[j*n + k]: row j = input stream j
    logits = m_comb.reshape(-1, n, n) * s_comb + b_comb.reshape(n, n)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    # Sinkhorn-Knopp: one column pass, then (iters - 1) row+column passes, eps in every divide
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


@register_reference("mhc_collapse")
def mhc_collapse_ref(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights.float().unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


@register_reference("mhc_collapse_rms_norm")
def mhc_collapse_rms_norm_ref(x: torch.Tensor, weights: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    return rms_norm_ref(mhc_collapse_ref(x, weights), norm_weight, eps)


@register_reference("mhc_expand")
def mhc_expand_ref(
    x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y_add: torch.Tensor | None = None
) -> torch.Tensor:
    # out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * x[t, j]  (contract the FIRST comb index)
    if y_add is not None:
        y = y + y_add  # the sublayer's output, in its dtype
    expanded = post.float().unsqueeze(-1) * y.float().unsqueeze(-2)
    mixed = torch.matmul(comb.float().transpose(-1, -2), x.float())
    return (expanded + mixed).to(x.dtype)


@register_reference("mhc_expand_collapse")
def mhc_expand_collapse_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    weights: torch.Tensor,
    y_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = mhc_expand_ref(x, y, post, comb, y_add)
    return out, mhc_collapse_ref(out, weights)


@register_reference("mhc_head_weights")
def mhc_head_weights_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
) -> torch.Tensor:
    mixes = _normed_mixes(x, fn, norm_eps)
    return sigmoid(mixes * scale.float() + base.float()) + hc_eps


@register_reference("mhc_pre_collapse_rms_norm")
def mhc_pre_collapse_rms_norm_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    eps: float,
) -> torch.Tensor:
    pre = mhc_head_weights_ref(x, fn, base, scale, norm_eps, hc_eps)
    return mhc_collapse_rms_norm_ref(x, pre, norm_weight, eps)

"""Plain-PyTorch MoE routing and SwiGLU experts (the definition of correct).

Routing is fp32 throughout. Experts compute in fp32 (weights upcast per expert), multiply the
routing weight into the SwiGLU activation before the down projection (DeepSeek reference
order), accumulate the k expert outputs in fp32 and cast to x.dtype once.

Row-invariant in fp32 on the CPU: every projection is the tiled ``linear_ref`` (a token's bits do
not depend on how many other tokens hit the same expert), the activations (softplus, sigmoid,
silu) are the row-invariant ones of ``_elementwise``, and a token's expert outputs are added
in a fixed order of its own (ascending expert id, then slot), whatever the other tokens route to.
"""

import torch

from deepinfer_kernels.ops._elementwise import sigmoid, silu, softplus
from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.registry import register_reference

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = logits.float()
    if scoring == "sqrtsoftplus":
        return softplus(logits).sqrt()
    if scoring == "sigmoid":
        return sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown MoE scoring function {scoring!r}; expected one of {SCORING_FUNCS}")


def _weights_at(
    scores: torch.Tensor, experts: torch.Tensor, route_scale: float, norm_topk: bool, norm_eps: float
) -> torch.Tensor:
    weights = scores.gather(1, experts)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + norm_eps)
    return weights * route_scale


@register_reference("moe_route_topk")
def moe_route_topk_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    route_scale: float,
    scoring: str = "sqrtsoftplus",
    norm_topk: bool = True,
    norm_eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(logits, scoring)
    selection = scores if bias is None else scores + bias.float()
    experts = torch.topk(selection, top_k, dim=-1).indices  # sorted, like the DeepSeek reference
    return _weights_at(scores, experts, route_scale, norm_topk, norm_eps), experts


@register_reference("moe_route_hash")
def moe_route_hash_ref(
    logits: torch.Tensor,
    tid2eid: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    route_scale: float,
    scoring: str = "sqrtsoftplus",
    norm_topk: bool = True,
    norm_eps: float = 1e-20,
    check_ranges: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(logits, scoring)
    check_hash_ranges(logits, tid2eid, input_ids, check_ranges)
    experts = tid2eid[input_ids.long()].long()
    return _weights_at(scores, experts, route_scale, norm_topk, norm_eps), experts


def check_hash_ranges(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor, check_ranges: bool) -> None:
    """moe_route_hash's range checks, shared by its backends (the same errors everywhere): the token ids index
    the table, the entries they pick lie in [0, E). They read the device: skipped when the caller checked the
    table once and the token ids at admission (check_ranges=False), and while a CUDA graph is captured."""
    if not check_ranges or (logits.is_cuda and torch.cuda.is_current_stream_capturing()) or not input_ids.numel():
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= tid2eid.shape[0]:
        raise ValueError(f"moe_route_hash: token ids span [{lo}, {hi}], table has {tid2eid.shape[0]} rows")
    experts = tid2eid[input_ids.long()]
    if experts.numel():
        lo, hi = int(experts.min()), int(experts.max())
        if lo < 0 or hi >= logits.shape[-1]:
            raise ValueError(f"moe_route_hash: tid2eid gives experts in [{lo}, {hi}], have {logits.shape[-1]}")


@register_reference("swiglu_clamp")
def swiglu_clamp_ref(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gate, up = gate.float(), up.float()
    if limit is not None:
        gate = gate.clamp(max=limit)  # one-sided on the gate
        up = up.clamp(min=-limit, max=limit)
    return (silu(gate) * up).to(out_dtype)


@register_reference("moe_experts")
def moe_experts_ref(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    swiglu_limit: float | None,
) -> torch.Tensor:
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = experts.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = experts.reshape(-1).long()
    if flat.numel() == 0:
        return out.to(x.dtype)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"moe_experts: expert ids span [{lo}, {hi}], but w13 holds {num_experts} experts")
    # group the (token, slot) pairs by expert; visit only experts that were hit
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xf = x.float()
    wf = weights.float().reshape(-1)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        gate_up = linear_ref(xf[tokens], w13[e].float())
        h = swiglu_clamp_ref(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        h = h * wf[pairs].unsqueeze(-1)  # routing weight before the down projection
        # experts are visited in ascending id and the pairs of one expert in (token, slot) order, so
        # each token sums its own k outputs in a fixed order (one exact add per element each)
        out.index_add_(0, tokens, linear_ref(h, w2[e].float()))
    return out.to(x.dtype)


@register_reference("swiglu_mlp")
def swiglu_mlp_ref(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, *, swiglu_limit: float | None
) -> torch.Tensor:
    xf = x.float()
    h = swiglu_clamp_ref(linear_ref(xf, w1.float()), linear_ref(xf, w3.float()), swiglu_limit)
    return linear_ref(h, w2.float()).to(x.dtype)

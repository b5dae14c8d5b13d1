"""Weight holders shared by the DeepSeek V4 and V4.1 models: parameters live under the checkpoint's
names, and every matrix product goes through the row-invariant ``deepinfer_kernels.linear``."""

from __future__ import annotations

import torch
from deepinfer_kernels import MhcConfig, MhcParams, linear, moe_experts, rms_norm
from torch import nn


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """Holds ``weight`` [out, in] under the checkpoint's name; y = x W^T in x's dtype, row-invariant."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def cat_rows(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=0)


class Experts(nn.Module):
    """Routed experts stacked per layer: ``w13`` [E, 2I, d] (gate rows then up rows) and ``w2`` [E, d, I].

    The MoE layers call the module (not ``moe_experts`` directly) so that expert parallelism can swap in a
    module with the same call that holds only this rank's experts (``deepinfer_runtime.distributed``)."""

    def __init__(self, n_experts: int, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w13 = param(n_experts, 2 * inter, hidden, dtype=dtype)
        self.w2 = param(n_experts, hidden, inter, dtype=dtype)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *, swiglu_limit: float | None
    ) -> torch.Tensor:
        """x [T, d], experts [T, k] int64 logical ids, weights [T, k] fp32 -> [T, d] in x.dtype."""
        return moe_experts(x, experts, weights, self.w13, self.w2, swiglu_limit=swiglu_limit)


class SharedExpert(nn.Module):
    def __init__(self, inter: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            Linear(hidden, inter, dtype),
            Linear(hidden, inter, dtype),
            Linear(inter, hidden, dtype),
        )


class MhcBlock(nn.Module):
    """Base of a DeepSeek V4 / V4.1 block: the mHC parameters of its two sites (attention, FFN) under the
    checkpoint's names ``hc_{attn,ffn}_{fn,base,scale}`` (fp32) and the coefficient settings."""

    def __init__(self, hc_mult: int, hidden: int, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
        super().__init__()
        mix = (2 + hc_mult) * hc_mult
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", param(mix, hc_mult * hidden, dtype=torch.float32))
            setattr(self, f"hc_{site}_base", param(mix, dtype=torch.float32))
            setattr(self, f"hc_{site}_scale", param(3, dtype=torch.float32))
        self.hc = MhcConfig(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)

    def mhc(self, site: str) -> MhcParams:
        return MhcParams(
            getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale")
        )

"""Plain-PyTorch interleaved RoPE on the trailing channels (the definition of correct)."""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("rope_interleaved")
def rope_interleaved_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    half = inv_freq.shape[0]
    rope_dim = 2 * half
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(device=x.device, dtype=torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    # broadcast [T, R/2] over the middle dims of x [T, ..., D]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -rope_dim:].float()
    a, b = rot[..., 0::2], rot[..., 1::2]
    # (a + ib) * (cos + i sin), written as two fused multiply-adds in fp32
    out_a = a * cos - b * sin
    out_b = b * cos + a * sin
    rotated = torch.stack((out_a, out_b), dim=-1).flatten(-2).to(x.dtype)
    if out is None:
        return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
    if out is not x:
        out[..., : x.shape[-1] - rope_dim].copy_(x[..., :-rope_dim])
    out[..., x.shape[-1] - rope_dim :].copy_(rotated)
    return out

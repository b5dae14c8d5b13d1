"""Rotary position embedding on the trailing channels with interleaved pairs, plain and YaRN."""

import math
from dataclasses import dataclass

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation (no attention-factor / mscale: DeepSeek V4 uses none).

    ``truncate`` floors/ceils the correction range as transformers and the DeepSeek reference do.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def rope_inv_freq(rope_dim: int, base: float, yarn: YarnScaling | None = None) -> torch.Tensor:
    """Inverse frequencies f_i = base^(-2i/rope_dim), i < rope_dim/2, fp32 [rope_dim/2].

    With ``yarn``: pairs below the correction range keep f_i, pairs above it use f_i/factor, and
    pairs inside blend linearly (f_i * ramp / factor + f_i * (1 - ramp)). For V4 (base 160000,
    64 dims, factor 16, original 65536, beta 32/1) the range is [15, 25].
    """
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = base**exponents
    inv_freq = 1.0 / pos_freqs
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (
            rope_dim
            * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001  # a degenerate range would divide by zero
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled frequency
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - keep) + inv_freq * keep


def rope_interleaved(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate the last R = 2*len(inv_freq) channels of x by angle position * inv_freq.

    Pairs are adjacent channels (2i, 2i+1) of the trailing slice, rotated as complex numbers
    (DeepSeek / vLLM ``is_neox_style=False``); the leading D - R channels pass through.
    ``inverse`` rotates by -angle (used on attention outputs, whose values carry RoPE since K = V).

    Args:
        x: [T, ..., D], any float dtype; the rotation is computed in fp32 and cast back.
        positions: [T] integer absolute positions, one per leading row of x (broadcast over the
            middle dims, e.g. heads).
        inv_freq: [R/2] fp32 from ``rope_inv_freq``.
        out: None (a new contiguous tensor), or a tensor of x's shape and dtype to write into; ``out=x`` rotates
            in place and touches only the trailing R channels (a decode or prefill query [T, 64, 512] with R = 64
            moves 1/8 of its bytes instead of reading and writing all of them). Any other ``out`` must not overlap x.

    Returns:
        [T, ..., D] in x.dtype (``out`` when given). See reference.py.
    """
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"rope: positions {tuple(positions.shape)} must be [T] with T = x.shape[0] = {x.shape[0]}")
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(f"rope: rope dim {2 * inv_freq.shape[0]} > head dim {x.shape[-1]}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(
            f"rope: out {tuple(out.shape)} {out.dtype} on {out.device} must match "
            f"x {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    return dispatch("rope_interleaved", x.device, x, positions, inv_freq, inverse, out=out)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

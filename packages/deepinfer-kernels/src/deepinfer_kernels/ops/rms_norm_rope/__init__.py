"""RMSNorm followed by interleaved RoPE on the trailing channels, in one op (one launch on the GPU).

The attention layers of DeepSeek V4 / V4.1 norm a latent and rotate its trailing channels straight away: V4's
per-head query norm, the window KV norm, the compressors' entries and V4.1's index keys. Fusing the two saves a
launch and a pass over the tensor, and keeps the intermediate rounding: the result is exactly
``rope_interleaved(rms_norm(x, weight, eps), positions, inv_freq)``.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = rope_interleaved(rms_norm(x, weight, eps), positions, inv_freq): each row of D channels is normed in fp32
    and rounded to x.dtype, then its trailing R = 2 * len(inv_freq) channels are rotated as adjacent pairs by
    angle position * inv_freq (fp32, rounded once more).

    Args:
        x: [T, ..., D], any float dtype (the norm is over D, every middle index separately: heads).
        weight: [D] (applied in fp32) or None for the unweighted norm.
        eps: added to the mean square.
        positions: [T] integer positions, one per leading row (broadcast over the middle dims).
        inv_freq: [R/2] fp32 (``rope_inv_freq``), R <= D.
        out, out_rows: given together, row t of the result goes to ``out[out_rows[t]]`` instead of a new tensor:
            out [N, ..., D] contiguous in x.dtype (a cache table: a window ring, a pool of compressed entries),
            out_rows [T] integer, a negative row not written (rows repeated: one of them wins). A decode step
            stores its new latents this way, without a scatter launch after the op.

    Returns:
        a new [T, ..., D] tensor in x.dtype, or ``out`` when given. See reference.py.
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_rope: weight shape {tuple(weight.shape)} != last dim of x {x.shape[-1]}")
    if x.dim() < 2 or positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(
            f"rms_norm_rope: x {tuple(x.shape)} must be [T, ..., D] and positions {tuple(positions.shape)} [T]"
        )
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(f"rms_norm_rope: rope dim {2 * inv_freq.shape[0]} > last dim {x.shape[-1]}")
    if (out is None) != (out_rows is None):
        raise ValueError("rms_norm_rope: out and out_rows go together")
    if out is not None:
        _check_out(x, out, out_rows)
        return dispatch("rms_norm_rope", x.device, x, weight, eps, positions, inv_freq, out=out, out_rows=out_rows)
    return dispatch("rms_norm_rope", x.device, x, weight, eps, positions, inv_freq)


def _check_out(x: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor) -> None:
    if out.dtype != x.dtype or out.shape[1:] != x.shape[1:] or not out.is_contiguous():
        raise ValueError(
            f"rms_norm_rope: out must be a contiguous [N, {', '.join(map(str, x.shape[1:]))}] {x.dtype} table, got "
            f"{tuple(out.shape)} {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if out_rows.shape != x.shape[:1] or out_rows.dtype.is_floating_point or out_rows.dtype == torch.bool:
        raise ValueError(
            f"rms_norm_rope: out_rows must be [{x.shape[0]}] integer rows of out, got {tuple(out_rows.shape)} "
            f"{out_rows.dtype}"
        )
    if out.device != x.device or out_rows.device != x.device:
        raise ValueError(f"rms_norm_rope: out / out_rows on {out.device} / {out_rows.device}, x on {x.device}")


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

__all__ = ["rms_norm_rope"]

"""Sparse multi-query attention (one shared K = V head) over gathered entries, with per-head sinks."""

import torch

from deepinfer_kernels.ops.rope import rope_interleaved
from deepinfer_kernels.registry import resolve

from . import reference as _reference  # noqa: F401  (registers the reference)


def sparse_mqa_attention(
    q: torch.Tensor,
    kv: torch.Tensor | tuple[torch.Tensor, ...],
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    *,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """o[t, h] = sum_k p[t, h, k] * kv[indices[t, k]], with
    p[t, h, k] = exp(s - m) / (sum_k' exp(s' - m) + exp(sink[h] - m)), s = scale * q[t, h] . kv[indices[t, k]]
    and m the max over the row's scores and the sink (the sink has no value vector).

    This is DeepSeek V4's attention core: every query attends to its own list of entries of one
    shared latent (the sliding-window keys and the selected compressed entries), K = V.

    Args:
        q: [T, H, D] queries (T tokens, H heads, D head dim), any float dtype.
        kv: [N, D] the entries the indices point into (same dtype family as q); or a tuple of such
            segments [N_i, D] (one dtype), addressed as their concatenation (index N_0 + j is row j of
            the second): the window rows of a step and a paged pool of compressed entries, say,
            without copying the pool. The GPU kernels read two segments in place.
        indices: [T, K] int64 rows of ``kv`` per query; -1 marks an unused slot. Order is free.
        sinks: [H] fp32 per-head sink logits.
        scale: softmax scale (D^-0.5 for DeepSeek V4).
        out_rope: optional (positions [T] int, inv_freq [R/2] fp32, R <= D, D - R even): the output is then
            ``rope_interleaved(o, positions, inv_freq, inverse=True)``, its trailing R channels of every head rotated
            back (DeepSeek V4's attention output), bitwise that op on the output. Backends that fuse it (the Triton
            ones: in the kernel that stores the output) take it; after the others the op runs on their output.

    Returns:
        [T, H, D] in q.dtype, computed in fp32. A row whose indices are all -1 gives zeros.
        See reference.py.
    """
    segments = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    if not segments or q.dim() != 3 or indices.dim() != 2 or any(s.dim() != 2 for s in segments):
        raise ValueError(
            f"sparse_mqa_attention: want q [T,H,D], kv [N,D] (or segments of them), indices [T,K]; got "
            f"{tuple(q.shape)}, {[tuple(s.shape) for s in segments]}, {tuple(indices.shape)}"
        )
    if (
        any(s.shape[-1] != q.shape[-1] or s.dtype != segments[0].dtype for s in segments)
        or indices.shape[0] != q.shape[0]
        or sinks.shape != (q.shape[1],)
    ):
        raise ValueError(
            f"sparse_mqa_attention: inconsistent shapes q {tuple(q.shape)}, kv {[tuple(s.shape) for s in segments]} "
            f"({[s.dtype for s in segments]}), indices {tuple(indices.shape)}, sinks {tuple(sinks.shape)}"
        )
    fn = resolve("sparse_mqa_attention", q.device)
    args = (q, segments if len(segments) > 1 else kv, indices, sinks, scale)
    if out_rope is None:
        return fn(*args)
    positions, inv_freq = out_rope
    d, half = q.shape[-1], inv_freq.shape[-1]
    if positions.shape != q.shape[:1] or inv_freq.dim() != 1 or 2 * half > d or (d - 2 * half) % 2:
        raise ValueError(
            f"sparse_mqa_attention: out_rope wants positions [T={q.shape[0]}] and inv_freq [R/2] with R <= D = {d}, "
            f"D - R even; got {tuple(positions.shape)}, {tuple(inv_freq.shape)}"
        )
    if getattr(fn, "fuses_out_rope", False):
        return fn(*args, out_rope=out_rope)
    out = fn(*args)
    return rope_interleaved(out, positions, inv_freq, inverse=True, out=out)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
try:  # the Gluon kernel (Hopper) needs a triton with triton.experimental.gluon
    from . import gluon as _gluon  # noqa: F401
except ImportError:
    pass

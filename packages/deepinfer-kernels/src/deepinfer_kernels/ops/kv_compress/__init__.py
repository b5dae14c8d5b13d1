"""KV compression: gated softmax pooling of token groups into compressed entries.

DeepSeek V4 compresses every ``ratio`` tokens of a layer's projected latent into one entry:
non-overlapping groups (HCA, ratio 128; V4.1's ratio-2 owners with no position bias) or, for
CSA (ratio 4), overlapping windows where entry w pools the A-halves of window w-1 and the
B-halves of window w (8 slots). ``overlap_windows`` lays the second case out as the first.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def kv_compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """c[..., w, :] = sum_l softmax_l(score[..., w, l, :]) * kv[..., w, l, :] (per channel, fp32).

    Args:
        kv: [..., W, L, C] latent rows grouped into W groups of L slots.
        score: [..., W, L, C] gate logits (position bias already added); -inf marks an empty slot.

    Returns:
        [..., W, C] in kv.dtype. See reference.py.
    """
    if kv.shape != score.shape or kv.dim() < 3:
        raise ValueError(f"kv_compress_pool: kv {tuple(kv.shape)} and score {tuple(score.shape)} must match, >= 3-D")
    return dispatch("kv_compress_pool", kv.device, kv, score)


def kv_compress_pool_rows(
    kv: torch.Tensor,
    score: torch.Tensor,
    rows: torch.Tensor,
    lead: int,
    width: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``kv_compress_pool`` of groups gathered from row tables (a decode step's compressor rings, read in place).

    Group b's slot l is row ``rows[b, l]`` of ``kv`` / ``score``: channels [0, width) of it for the ``lead``
    leading slots, channels [Ck - width, Ck) for the others (CSA's overlapping windows: the previous window's
    A-halves, then this window's B-halves; with Ck == width every slot reads the whole row). A slot with row -1 is
    empty (weight 0); a group whose slots are all empty gives NaN (as an all -inf softmax does), unread.

    Args:
        kv: [N, Ck] row table (fp32 in the models), row-contiguous.
        score: [N, Ck] gate logits of the same rows, same dtype.
        rows: [B, L] int64 row ids into the tables, -1 = empty slot.
        lead: number of leading slots reading channels [0, width).
        width: C, the pooled width (Ck or Ck / 2).
        out_dtype: the result's dtype (default kv.dtype): the pooled values rounded once, bitwise ``.to(out_dtype)``
            of the kv.dtype result when kv is fp32 (a decode step's entries in the model dtype without a cast kernel).

    Returns:
        [B, C] in out_dtype: bitwise ``kv_compress_pool`` of the gathered [B, L, C] groups on every backend that
        serves both (the reference gathers and calls the reference; the Triton kernel shares its reduction).
    """
    if kv.shape != score.shape or kv.dim() != 2 or rows.dim() != 2:
        raise ValueError(
            f"kv_compress_pool_rows: kv {tuple(kv.shape)} and score {tuple(score.shape)} must be equal [N, Ck] "
            f"tables and rows [B, L] (got {tuple(rows.shape)})"
        )
    if not 0 < width <= kv.shape[1] or not 0 <= lead <= rows.shape[1]:
        raise ValueError(
            f"kv_compress_pool_rows: width {width} / lead {lead} outside the tables' {kv.shape[1]} "
            f"channels / the groups' {rows.shape[1]} slots"
        )
    if rows.dtype != torch.int64:
        raise ValueError(f"kv_compress_pool_rows: rows must be int64, got {rows.dtype}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"kv_compress_pool_rows: out_dtype must be a float dtype, got {out_dtype}")
    return dispatch("kv_compress_pool_rows", kv.device, kv, score, rows, int(lead), int(width), out_dtype)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass


def overlap_windows(
    kv: torch.Tensor,
    score: torch.Tensor,
    prev_kv: torch.Tensor | None = None,
    prev_score: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay out CSA's overlapping windows as plain groups of 2r slots.

    Args:
        kv, score: [W, r, 2C] projected rows of W consecutive complete windows; channels
            [:C] are the A-half (feeds the next window's entry), [C:] the B-half (this window's).
        prev_kv, prev_score: [r, C] the A-halves of the window just before these W (from an
            earlier chunk), or None at the start of the sequence (those slots are empty).

    Returns:
        (kv [W, 2r, C], score [W, 2r, C]): slots [0, r) hold window w-1's A-half, [r, 2r) window
        w's B-half; empty slots have kv 0 and score -inf so they get softmax weight 0.
    """
    w, r, two_c = kv.shape
    c = two_c // 2
    out_kv = kv.new_zeros(w, 2 * r, c)
    out_score = score.new_full((w, 2 * r, c), float("-inf"))
    out_kv[:, r:] = kv[..., c:]
    out_score[:, r:] = score[..., c:]
    out_kv[1:, :r] = kv[:-1, :, :c]
    out_score[1:, :r] = score[:-1, :, :c]
    if prev_kv is not None:
        out_kv[0, :r] = prev_kv
        out_score[0, :r] = prev_score
    return out_kv, out_score

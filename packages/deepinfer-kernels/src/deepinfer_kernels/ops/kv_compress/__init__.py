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

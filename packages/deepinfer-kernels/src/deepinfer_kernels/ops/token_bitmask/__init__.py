"""Token bitmasks: set the logits of disallowed tokens to -inf (structured outputs, grammar-constrained decoding)."""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits[b, v] = -inf wherever bit (v % 32) of bitmask[b, v // 32] is 0, **in place**; returns ``logits``.

    Args:
        logits: [B, V] floating point, modified in place (also returned).
        bitmask: [B, W] int32 with W >= ceil(V / 32), on the logits' device. Bit i of word w (little end
            first: ``(word >> i) & 1``, the sign bit is bit 31) allows token 32 * w + i. Bits for tokens
            >= V (the padding of the last word) are ignored. A row of all ones (-1) leaves its logits as is.
        rows: optional int64 [R] indices into the batch: only those rows are masked, the others are not
            touched whatever their bitmask says (the caller skips unconstrained requests). None: all rows.

    Returns:
        ``logits``. A row whose bits are all 0 becomes all -inf; NaN logits of allowed tokens stay NaN.

    Row-invariant (batch-invariant): elementwise, so each row depends only on its own logits and bitmask.
    See reference.py.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"apply_token_bitmask: logits [B, V] and bitmask [B, W] expected, got {tuple(logits.shape)} "
            f"and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask: bitmask must be int32, got {bitmask.dtype}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"apply_token_bitmask: bitmask has {bitmask.shape[1]} words per row, {logits.shape[1]} tokens need "
            f"{(logits.shape[1] + 31) // 32}"
        )
    return dispatch("token_bitmask", logits.device, logits, bitmask, rows)

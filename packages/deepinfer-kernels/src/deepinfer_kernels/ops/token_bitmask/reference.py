"""Plain-PyTorch token bitmask (the definition of correct): unpack the bits with shifts, one masked fill."""

import torch

from deepinfer_kernels.registry import register_reference


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: True where the token is allowed (bit v % 32 of word v // 32)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # Arithmetic shift of int32 keeps the sign bit in place; `& 1` then reads bit 31 correctly too.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


@register_reference("token_bitmask")
def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    if rows is not None:
        # Rows outside `rows` get an all-ones mask (a no-op fill): cheaper than gathering and scattering
        # whole logit rows, and those rows stay bitwise untouched.
        selected = torch.full_like(bitmask, -1)
        rows = rows.to(device=bitmask.device, dtype=torch.long)
        selected[rows] = bitmask[rows]
        bitmask = selected
    logits.masked_fill_(~unpack_bitmask(bitmask, logits.shape[1]), float("-inf"))
    return logits

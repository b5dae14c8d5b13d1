"""Decision D6: the drafts of the first decode step after prefill.

DeepInfer drafts nothing during prefill. The first decode step of a request therefore carries N
placeholder drafts: id V-1, a one-hot draft distribution on V-1, confidence 0. With varlen off they
are verified like real drafts: the target almost never puts mass on V-1, so d_1 is rejected and the
anchor row's token comes from the residual stream (c = 1), where the residual is q with V-1 scaled
down. With varlen on their survival is 0, so normally only the anchor row is verified.

Statistics skip that step (``SpecStats.record(..., placeholder=True)``).
"""

from __future__ import annotations

import torch

from .protocol import Drafts


def placeholder_drafts(batch_size: int, num_tokens: int, vocab_size: int, device: torch.device | str = "cpu") -> Drafts:
    """D6 placeholder drafts: tokens V-1 int64 [B, N], one-hot logprobs fp32 [B, N, V] (0 at V-1,
    -inf elsewhere), confidences 0 fp32 [B, N]."""
    if batch_size < 0 or num_tokens < 1 or vocab_size < 1:
        raise ValueError(f"placeholder_drafts: bad sizes B={batch_size}, N={num_tokens}, V={vocab_size}")
    tokens = torch.full((batch_size, num_tokens), vocab_size - 1, dtype=torch.int64, device=device)
    logprobs = torch.full((batch_size, num_tokens, vocab_size), float("-inf"), dtype=torch.float32, device=device)
    logprobs[..., vocab_size - 1] = 0.0
    confidences = torch.zeros((batch_size, num_tokens), dtype=torch.float32, device=device)
    return Drafts(tokens, logprobs, confidences)

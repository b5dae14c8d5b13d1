"""Per-request state of the DeepSeek-V4 reference model (the paged engine pools are separate).

One ``SequenceCache`` per request holds, per layer, the sliding-window tail and each
compressor's state. The model appends to it as it runs, so a full forward, chunked prefill and
token-by-token decode are the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """A compressor's carried state for one request.

    pending_kv/pending_score: [p, C'] projected rows of the incomplete group (p < ratio).
    prev_kv/prev_score: [ratio, C] A-halves of the last complete window (overlapping CSA only).
    entries: [N, C] compressed entries emitted so far (post-norm, post-RoPE).
    """

    pending_kv: torch.Tensor | None = None
    pending_score: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]


@dataclass
class LayerCache:
    """window: [<= window-1, D] the newest post-RoPE latents (positions seq_len-len .. seq_len-1)."""

    window: torch.Tensor | None = None
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)


@dataclass
class SequenceCache:
    layers: list[LayerCache]
    seq_len: int = 0

    @classmethod
    def empty(cls, num_layers: int) -> SequenceCache:
        return cls([LayerCache() for _ in range(num_layers)])

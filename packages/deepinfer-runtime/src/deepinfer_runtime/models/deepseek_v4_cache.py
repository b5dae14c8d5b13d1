"""Per-request state of the DeepSeek-V4 model.

One ``SequenceCache`` per request holds, per layer, the sliding-window tail and each compressor's
state. The model appends to it as it runs, so a full forward, chunked prefill and token-by-token
decode are the same code path. Compressed entries are row stores (``kv_pool``): standalone tensors by
default, pool blocks under the engine. The model replaces the fixed-size tensors rather than writing
into them, which is what makes ``snapshot`` (prefix caching) a cheap clone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer_runtime.kv_pool import CacheSnapshot, RowStore, TensorRows

RowFactory = Callable[[object, int], RowStore]


def _standalone(key: object, ratio: int) -> RowStore:
    return TensorRows()


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


@dataclass
class CompressorState:
    """A compressor's carried state for one request.

    pending_kv/pending_score: [p, C'] projected rows of the incomplete group (p < ratio).
    prev_kv/prev_score: [ratio, C] A-halves of the last complete window (overlapping CSA only).
    entries: [N, C] compressed entries emitted so far (post-norm, post-RoPE), a row store made by
    ``new_rows(key, ratio)`` on first use.
    """

    key: object = None
    new_rows: RowFactory = field(default=_standalone, repr=False)
    pending_kv: torch.Tensor | None = None
    pending_score: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    entries: RowStore | None = None
    ratio: int = 0

    def store(self, ratio: int) -> RowStore:
        if self.entries is None:
            self.entries, self.ratio = self.new_rows(self.key, ratio), ratio
        return self.entries

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else len(self.entries)

    def tail(self) -> tuple:
        return tuple(_clone(t) for t in (self.pending_kv, self.pending_score, self.prev_kv, self.prev_score))


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
    def empty(cls, num_layers: int, new_rows: RowFactory | None = None) -> SequenceCache:
        rows = new_rows or _standalone
        return cls(
            [
                LayerCache(compressor=CompressorState(("comp", i), rows), indexer=CompressorState(("idx", i), rows))
                for i in range(num_layers)
            ]
        )

    def _states(self):
        for i, lc in enumerate(self.layers):
            yield ("comp", i), lc.compressor
            yield ("idx", i), lc.indexer

    def snapshot(self) -> CacheSnapshot:
        """Windows and compressor tails cloned; entries by (ratio, length) only (they stay in the pool)."""
        fixed = SequenceCache([LayerCache(window=_clone(lc.window)) for lc in self.layers], self.seq_len)
        tails = {k: s.tail() for k, s in self._states()}
        lengths = {k: (s.ratio, s.num_entries) for k, s in self._states() if s.entries is not None}
        return CacheSnapshot(fixed, tails, lengths)

    @classmethod
    def restore(cls, snap: CacheSnapshot, new_rows: RowFactory) -> SequenceCache:
        cache = cls.empty(len(snap.fixed.layers), new_rows)
        cache.seq_len = snap.fixed.seq_len
        for lc, old in zip(cache.layers, snap.fixed.layers):
            lc.window = old.window
        for key, state in cache._states():
            state.pending_kv, state.pending_score, state.prev_kv, state.prev_score = snap.tails[key]
            if key in snap.lengths:
                ratio, n = snap.lengths[key]
                state.store(ratio).resume(n)
        return cache

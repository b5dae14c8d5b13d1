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
from typing import Any

import torch

from deepinfer_runtime.kv_pool import CacheSnapshot, RowStore, TensorRows
from deepinfer_runtime.models.layers import cat_rows

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
    backtrack: int = 0  # B > 0: keep the projections a rollback of up to B rows needs (recent_*)
    recent_kv: torch.Tensor | None = None  # [<= 2*ratio - 1 + B, C] the last projected rows
    recent_score: torch.Tensor | None = None
    prev_width: int = 0  # C of prev_kv (overlapping CSA), 0 without overlap

    def remember(self, kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap_width: int) -> None:
        """Record freshly projected rows in the rollback ring (only when B > 0)."""
        if self.backtrack:
            self.ratio = ratio
            keep = (2 if overlap_width else 1) * ratio - 1 + self.backtrack  # + the previous window
            self.recent_kv = cat_rows(self.recent_kv, kv)[-keep:]
            self.recent_score = cat_rows(self.recent_score, score)[-keep:]
            self.prev_width = overlap_width

    def rollback(self, old_len: int, new_len: int) -> None:
        """Forget the rows fed after ``new_len`` (of ``old_len``): entries of groups no longer complete; the
        pending group and the previous window's A-halves rebuilt from the ring."""
        if not self.ratio:  # never fed
            return
        r = self.ratio
        n = new_len // r
        if self.entries is not None:
            self.entries.truncate(n)
        have = 0 if self.recent_kv is None else self.recent_kv.shape[0]
        first = old_len - have  # position of recent row 0
        need = (n - 1) * r if self.prev_width and n else n * r
        if need < first:
            raise RuntimeError(f"rollback to {new_len} needs projections from {need}; the ring starts at {first}")
        lo, hi = n * r - first, new_len - first
        self.pending_kv, self.pending_score = self.recent_kv[lo:hi], self.recent_score[lo:hi]
        if self.prev_width:
            prev = slice(lo - r, lo)
            self.prev_kv = self.recent_kv[prev, : self.prev_width] if n else None
            self.prev_score = self.recent_score[prev, : self.prev_width] if n else None
        self.recent_kv, self.recent_score = self.recent_kv[:hi], self.recent_score[:hi]

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
    backtrack: int = 0  # the window keeps B rows beyond the W - 1 it attends to (speculative rollback)

    def append_window(self, kv: torch.Tensor, window: int, start: int) -> tuple[torch.Tensor, int]:
        """Append latents kv [S, D] of positions start..; returns rows [window | kv] and the position of their
        row 0. Keeps the last W - 1 rows to attend to and B more to roll back into."""
        rows = cat_rows(self.window, kv)
        keep = window - 1 + self.backtrack
        self.window = rows[-keep:] if keep > 0 else rows[:0]
        return rows, start - (rows.shape[0] - kv.shape[0])

    def drop_window(self, num_tokens: int) -> None:
        """Forget the newest ``num_tokens`` window rows (rolled-back tokens)."""
        if self.window is not None:
            self.window = self.window[: max(self.window.shape[0] - num_tokens, 0)]


@dataclass
class SequenceCache:
    layers: list[LayerCache]
    seq_len: int = 0
    mtp: Any = None  # the MTP layer's ``MTPState`` when the model drafts with it (deepseek_v4_mtp)

    @classmethod
    def empty(cls, num_layers: int, new_rows: RowFactory | None = None, backtrack: int = 0) -> SequenceCache:
        """``backtrack`` B sizes the rings so that ``rollback`` can undo up to B tokens."""
        rows = new_rows or _standalone
        return cls(
            [
                LayerCache(
                    compressor=CompressorState(("comp", i), rows, backtrack=backtrack),
                    indexer=CompressorState(("idx", i), rows, backtrack=backtrack),
                    backtrack=backtrack,
                )
                for i in range(num_layers)
            ]
        )

    @property
    def backtrack(self) -> int:
        return self.layers[0].backtrack if self.layers else 0

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens (rejected drafts), at most B: the state becomes exactly that
        of a cache that never ran them."""
        if not num_tokens:
            return
        if num_tokens > self.backtrack:
            raise RuntimeError(
                f"rollback of {num_tokens} tokens exceeds the cache's backtrack ring B = {self.backtrack}"
            )
        old, new = self.seq_len, self.seq_len - num_tokens
        for lc in self.layers:
            lc.drop_window(num_tokens)
        for _, state in self._states():
            state.rollback(old, new)
        self.seq_len = new

    def _states(self):
        for i, lc in enumerate(self.layers):
            yield ("comp", i), lc.compressor
            yield ("idx", i), lc.indexer

    def snapshot(self) -> CacheSnapshot:
        """Windows and compressor tails cloned; entries by (ratio, length) only (they stay in the pool)."""
        mtp = None if self.mtp is None else self.mtp.clone()
        fixed = SequenceCache([LayerCache(window=_clone(lc.window)) for lc in self.layers], self.seq_len, mtp)
        tails = {k: s.tail() for k, s in self._states()}
        lengths = {k: (s.ratio, s.num_entries) for k, s in self._states() if s.entries is not None}
        return CacheSnapshot(fixed, tails, lengths)

    @classmethod
    def restore(cls, snap: CacheSnapshot, new_rows: RowFactory, backtrack: int = 0) -> SequenceCache:
        cache = cls.empty(len(snap.fixed.layers), new_rows, backtrack)
        cache.seq_len = snap.fixed.seq_len
        cache.mtp = None if snap.fixed.mtp is None else snap.fixed.mtp.clone()
        for lc, old in zip(cache.layers, snap.fixed.layers):
            lc.window = old.window
        for key, state in cache._states():
            state.pending_kv, state.pending_score, state.prev_kv, state.prev_score = snap.tails[key]
            state.recent_kv, state.recent_score = state.pending_kv, state.pending_score
            if backtrack and state.prev_kv is not None:  # the ring also holds the previous window (A-halves)
                state.prev_width = w = state.prev_kv.shape[1]
                kv, score = (
                    torch.nn.functional.pad(state.prev_kv, (0, w)),
                    torch.nn.functional.pad(state.prev_score, (0, w)),
                )
                if state.pending_kv is not None:
                    kv, score = torch.cat([kv, state.pending_kv]), torch.cat([score, state.pending_score])
                state.recent_kv, state.recent_score = kv, score
            if key in snap.lengths:
                ratio, n = snap.lengths[key]
                state.store(ratio).resume(n)
        return cache

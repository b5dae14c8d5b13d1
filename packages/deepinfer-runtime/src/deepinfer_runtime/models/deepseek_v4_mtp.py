"""DeepSeek-V4-Flash's MTP layer (``mtp.0.*``, section A.9) and its per-request state, for drafting.

The layer is a sliding-window block fed with the backbone's residual streams *before* its mHC head and the
embedding of the next token: for position i,

    X0_j = h_proj(hnorm(X_main[i, j])) + e_proj(enorm(embed(t_{i+1})))   for each stream j,
    X1 = Block(X0) at RoPE position i (its own window KV cache),
    logits = head(norm(hc_head(X1)))                                      (fp32; embed and head shared),

and ``logits`` predict t_{i+2}. The embedding is zeroed at position 0 (vLLM's convention, kept: section A.9
leaves the position convention UNCONFIRMED against a DeepSeek reference). With k > 1 drafts the layer chains
on itself: the next row takes its own output streams X1 as X_main and the draft it just proposed.

Work per draft step is small because only the last W rows matter: the layer attends to a window of W positions
and a row's key depends on that row alone (its X0), so rows older than W - 1 positions before the newest one can
never be read again. ``MTPState`` therefore keeps the newest W + B backbone streams and the layer's window ring
(two rings of the request's cache slot, ``slot_pool``); the layer runs the rows whose next token is known when
drafting, i.e. after the step's tokens were accepted, so rejected drafts never enter its cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from deepinfer_kernels import linear, mhc_head_weights

from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
from deepinfer_runtime.models.layers import Linear, Norm
from deepinfer_runtime.slot_pool import Ring

if TYPE_CHECKING:
    from deepinfer_runtime.models.deepseek_v4_cache import LayerCache


def head_logits(x: torch.Tensor, hc: tuple, norm: Norm, head: Linear, cfg: DeepseekV4Config) -> torch.Tensor:
    """Streams x [T, n, d] -> fp32 logits [T, V]: mHC head collapse (``hc`` = fn, base, scale), final norm, LM head
    in fp32. Shared by the backbone and the MTP layers."""
    pre = mhc_head_weights(x, *hc, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    return linear(norm.collapse(x, pre), head.weight, out_dtype=torch.float32)


MTP_WINDOW, MTP_STREAMS = ("mtp", "window"), ("mtp", "streams")  # slot keys of the two rings (``v4_slot_specs``)


@dataclass
class MTPState:
    """One request's MTP state, two rings of its cache slot.

    window: the MTP block's ``LayerCache`` (window ring [W - 1 + B, head_dim]; B for the chained draft rows it
        takes back).
    streams: ring [W + B, n * d] (model dtype) of the newest backbone streams by position (older rows are never
        needed; a rollback of up to B positions still leaves the W the next draft's window reads).
    seq_len: positions run through the layer and kept (0 .. seq_len - 1).
    """

    window: LayerCache
    streams: Ring
    seq_len: int = 0

    def push(self, x: torch.Tensor, start: int) -> None:
        """Backbone streams x [S, n, d] of positions start .. start + S - 1 (a gap starts the ring over)."""
        self.streams.write(start, x.flatten(1))

    def truncate(self, num_tokens: int) -> None:
        """The backbone rolled back to ``num_tokens`` tokens: forget streams of later positions."""
        if self.streams.end > num_tokens:
            self.streams.rollback(self.streams.end - num_tokens)
        if self.seq_len > num_tokens:  # never happens in the engine (the layer runs accepted rows only)
            raise RuntimeError(f"MTP state ran {self.seq_len} positions; cannot roll back to {num_tokens}")

    def take(self, stop: int, hc_mult: int) -> tuple[torch.Tensor, int]:
        """The streams [k, n, d] of positions first .. stop - 1 not run through the layer yet, and ``first``. After
        a gap (rows never kept) the window ring starts over too: its rows could no longer be read."""
        if self.streams.end < stop:
            have = self.streams.end - 1
            raise RuntimeError(f"MTP needs backbone streams up to position {stop - 1}; it has them up to {have}")
        first = max(self.seq_len, self.streams.lo)
        rows = self.streams.read(first, stop)
        return rows.view(rows.shape[0], hc_mult, -1), first

    def drop_chained(self, num_rows: int) -> None:
        """Take the chained draft rows back out of the window ring."""
        self.window.window.rollback(num_rows)

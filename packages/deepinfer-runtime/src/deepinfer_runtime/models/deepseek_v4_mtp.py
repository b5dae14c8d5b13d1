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
never be read again. ``MTPState`` therefore keeps the backbone streams not yet run through the layer (at most W
rows: older ones are skipped) and the layer's window ring; the layer runs the rows whose next token is known
when drafting, i.e. after the step's tokens were accepted, so rejected drafts never enter its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_kernels import linear, mhc_collapse, mhc_head_weights

from deepinfer_runtime.models.deepseek_v4_cache import LayerCache
from deepinfer_runtime.models.deepseek_v4_config import DeepseekV4Config
from deepinfer_runtime.models.layers import Linear, Norm, cat_rows


def head_logits(x: torch.Tensor, hc: tuple, norm: Norm, head: Linear, cfg: DeepseekV4Config) -> torch.Tensor:
    """Streams x [T, n, d] -> fp32 logits [T, V]: mHC head collapse (``hc`` = fn, base, scale), final norm, LM head
    in fp32. Shared by the backbone and the MTP layers."""
    pre = mhc_head_weights(x, *hc, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    return linear(norm(mhc_collapse(x, pre)).float(), head.weight.float())


@dataclass
class MTPState:
    """One request's MTP state.

    pending: [p, n, d] backbone streams (model dtype) of positions ``pending_start`` .. ``pending_start + p - 1``,
        the newest ones the backbone computed (at most ``keep`` = W + B rows; older rows are never needed).
    window: the MTP block's window ring (W - 1 + B rows, B for the chained draft rows it takes back).
    seq_len: positions run through the layer and kept (0 .. seq_len - 1).
    """

    window: LayerCache
    pending: torch.Tensor | None = None
    pending_start: int = 0
    seq_len: int = 0
    keep: int = 0  # W: the pending rows worth keeping

    def push(self, streams: torch.Tensor, start: int) -> None:
        """Backbone streams [S, n, d] of positions start .. start + S - 1 (a re-run position replaces its row)."""
        extra = max(streams.shape[0] - self.keep, 0)
        streams, start = streams[extra:], start + extra
        if self.pending is not None:
            kept = self.pending[: max(start - self.pending_start, 0)]
            if self.pending_start + kept.shape[0] == start:  # contiguous: extend (else a gap: start over)
                streams, start = cat_rows(kept, streams), self.pending_start
        drop = max(streams.shape[0] - self.keep, 0)
        self.pending, self.pending_start = streams[drop:], start + drop

    def truncate(self, num_tokens: int) -> None:
        """The backbone rolled back to ``num_tokens`` tokens: forget streams of later positions."""
        if self.pending is not None:
            self.pending = self.pending[: max(num_tokens - self.pending_start, 0)]
        if self.seq_len > num_tokens:  # never happens in the engine (the layer runs accepted rows only)
            raise RuntimeError(f"MTP state ran {self.seq_len} positions; cannot roll back to {num_tokens}")

    def take(self, stop: int) -> tuple[torch.Tensor, int]:
        """The pending streams of positions < ``stop`` not yet run, and the first one's position; a gap since the
        last run row (skipped rows) restarts the window ring, whose rows could no longer be read anyway."""
        if self.pending is None or self.pending_start + self.pending.shape[0] < stop:
            have = 0 if self.pending is None else self.pending_start + self.pending.shape[0]
            raise RuntimeError(f"MTP needs backbone streams up to position {stop - 1}; it has them up to {have - 1}")
        first = max(self.seq_len, self.pending_start)
        if first > self.seq_len:
            self.window = LayerCache(backtrack=self.window.backtrack)
        rows = self.pending[first - self.pending_start : stop - self.pending_start]
        return rows, first

    def clone(self) -> MTPState:
        """An independent copy (prefix-cache snapshots and their restores)."""
        ring = None if self.window.window is None else self.window.window.clone()
        pending = None if self.pending is None else self.pending.clone()
        return MTPState(
            LayerCache(ring, backtrack=self.window.backtrack), pending, self.pending_start, self.seq_len, self.keep
        )


def mtp_state(cfg: DeepseekV4Config, backtrack: int) -> MTPState:
    """An empty state. Pending keeps W + B rows: a rollback of up to B positions must leave the W that the
    next draft's window reads."""
    return MTPState(LayerCache(backtrack=backtrack), keep=cfg.sliding_window + backtrack)

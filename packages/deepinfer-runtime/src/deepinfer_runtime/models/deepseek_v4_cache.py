"""Per-request state of the DeepSeek-V4 model.

One ``SequenceCache`` per request holds, per layer, the sliding-window latents and each compressor's state.
The model appends to it as it runs, so a full forward, chunked prefill and token-by-token decode are the same
code path. Compressed entries are row stores (``kv_pool``): standalone tensors by default, pool blocks under
the engine. The fixed-size state lives in one slot of a ``slot_pool.SlotPool`` (the engine's, or a private
one-slot pool), as rings written in place by position; ``snapshot`` copies the slot on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer_runtime.kv_pool import RowStore, TensorRows
from deepinfer_runtime.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config
from deepinfer_runtime.models.deepseek_v4_mtp import MTP_STREAMS, MTP_WINDOW, MTPState
from deepinfer_runtime.slot_pool import CacheSnapshot, Ring, SlotSpec, SlotState, append_window, check_rollback

RowFactory = Callable[[object, int], RowStore]


def _standalone(key: object, ratio: int) -> RowStore:
    return TensorRows()


@dataclass(frozen=True)
class CompressorPlan:
    """One compressor of the model: ``ratio``, projection width C' (2 x entry width with overlap) and the width
    of the carried A-halves (``prev_width``, overlapping CSA; 0 without overlap)."""

    ratio: int
    width: int
    prev_width: int

    def ring_rows(self, backtrack: int) -> int:
        """ratio - 1 rows of the incomplete group, ratio more with overlap (the previous window), B for rollback."""
        return self.ratio - 1 + (self.ratio if self.prev_width else 0) + backtrack

    def capacity(self, backtrack: int) -> int:
        """Rows of its rings: ``ring_rows`` and the newest row, so that a planned decode step reads the whole group
        in place after writing its row (``decode_batch.ring_ids``)."""
        return self.ring_rows(backtrack) + 1


def v4_compressors(cfg: DeepseekV4Config) -> dict[tuple[str, int], CompressorPlan]:
    """("comp" | "idx", layer) -> plan, for every compressor of the backbone (HCA, CSA and its indexer)."""
    out = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_types[i]
        if kind == SLIDING:
            continue
        csa = kind == CSA
        d = cfg.head_dim
        out[("comp", i)] = CompressorPlan(cfg.compress_rates[kind], 2 * d if csa else d, d if csa else 0)
        if csa:
            dh = cfg.index_head_dim
            out[("idx", i)] = CompressorPlan(cfg.compress_rates[CSA], 2 * dh, dh)
    return out


def v4_slot_specs(
    cfg: DeepseekV4Config, dtype: torch.dtype, backtrack: int = 0, mtp: bool = False, dspark: bool = False
) -> list[SlotSpec]:
    """The fixed buffers of one request: per layer the window ring [W + B, head_dim] in ``dtype``; per
    compressor the projection rings (kv, score) [``capacity``, C'] fp32; with ``mtp`` the MTP layer's window ring
    and the ring of backbone streams it drafts from [W + B, hc_mult * hidden] (``deepseek_v4_mtp``); with
    ``dspark`` one context ring [W + B, head_dim] per DSpark stage (its keys of the target rows)."""
    specs = [
        SlotSpec(("window", i), "window latents", cfg.sliding_window + backtrack, cfg.head_dim, dtype)
        for i in range(cfg.num_hidden_layers)
    ]
    for key, plan in v4_compressors(cfg).items():
        for part in ("kv", "score"):
            specs.append(
                SlotSpec((*key, part), "compressor state (fp32)", plan.capacity(backtrack), plan.width, torch.float32)
            )
    if mtp:
        w, b = cfg.sliding_window, backtrack
        specs.append(SlotSpec(MTP_WINDOW, "MTP window latents", w - 1 + b, cfg.head_dim, dtype))
        specs.append(SlotSpec(MTP_STREAMS, "MTP backbone streams", w + b, cfg.hc_mult * cfg.hidden_size, dtype))
    if dspark:
        w, b = cfg.sliding_window, backtrack
        specs += [
            SlotSpec(("dspark", k), "DSpark context", w + b, cfg.head_dim, dtype) for k in range(cfg.dspark.num_stages)
        ]
    return specs


@dataclass
class CompressorState:
    """A compressor's carried state for one request.

    kv / score: rings of the projected rows [R, C'] fp32 (score with the position bias) by position, R =
    ``plan.capacity(B)``: the incomplete group (positions num_entries * ratio ..), with overlap the previous
    window too (whose A-halves [:, :prev_width] the next group reads), the newest row and B rows for rollback.
    entries: [N, C] compressed entries emitted so far (post-norm, post-RoPE), a row store made by
    ``new_rows(key, ratio)`` on first use.
    """

    key: object
    kv: Ring
    score: Ring
    plan: CompressorPlan
    new_rows: RowFactory = field(default=_standalone, repr=False)
    entries: RowStore | None = None

    @property
    def ratio(self) -> int:
        return self.plan.ratio

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else len(self.entries)

    def carried(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(pending kv, pending score) of the incomplete group [p, C'] and, with overlap, the previous window's
        A-halves (prev kv, prev score) [ratio, prev_width] (None before the first complete window)."""
        r, n, end = self.ratio, self.num_entries, self.kv.end
        pending = self.kv.read(n * r, end), self.score.read(n * r, end)
        if not (self.plan.prev_width and n):
            return (*pending, None, None)
        w = self.plan.prev_width
        return (*pending, self.kv.read((n - 1) * r, n * r)[:, :w], self.score.read((n - 1) * r, n * r)[:, :w])

    def write(self, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Record freshly projected rows [S, C'] (the compressor is fed every row in order: they follow the
        ring's end)."""
        start = self.kv.end
        self.kv.write(start, kv)
        self.score.write(start, score)

    def rollback(self, old_len: int, new_len: int) -> None:
        """Forget the rows fed after ``new_len`` (of ``old_len``): entries of groups no longer complete; the
        pending group and the previous window stay in the rings."""
        r = self.ratio
        n = new_len // r
        if self.entries is not None:
            self.entries.truncate(n)
        need = (n - 1) * r if self.plan.prev_width and n else n * r
        if need < self.kv.lo:
            raise RuntimeError(f"rollback to {new_len} needs projections from {need}; the ring starts at {self.kv.lo}")
        self.kv.rollback(old_len - new_len)
        self.score.rollback(old_len - new_len)

    def store(self) -> RowStore:
        if self.entries is None:
            self.entries = self.new_rows(self.key, self.ratio)
        return self.entries


@dataclass
class LayerCache:
    """window: ring [W + B, D] of the newest post-RoPE latents; compressor / indexer: None on layers
    without them."""

    window: Ring
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def append_window(self, kv: torch.Tensor, window: int, start: int) -> tuple[torch.Tensor, int]:
        """Append latents kv [S, D] of positions start..; returns the rows [held window rows | kv] the queries
        attend over and the position of their row 0 (``slot_pool.append_window``)."""
        return append_window(self.window, kv, window, start)


@dataclass
class SequenceCache:
    """One request's state. dspark_ctx[s] (with a DSpark head): ring [W + B, head_dim] of DSpark stage s's context
    keys by position (positions .. ctx_end - 1)."""

    layers: list[LayerCache]
    slots: SlotState
    seq_len: int = 0
    backtrack: int = 0  # B: tokens a speculative step may roll back; rings keep B rows beyond their need
    mtp: MTPState | None = None  # the MTP layer's drafting state, when the slot has its rings
    ctx_end: int = 0

    def __post_init__(self):
        self.dspark_ctx = {key[1]: ring for key, ring in self.slots.rings.items() if key[0] == "dspark"}

    @classmethod
    def empty(
        cls, cfg: DeepseekV4Config, slots: SlotState, new_rows: RowFactory | None = None, backtrack: int = 0
    ) -> SequenceCache:
        """A cache over ``slots`` (a slot of a pool made from ``v4_slot_specs(cfg, dtype, backtrack)``); ``backtrack``
        B sizes the rings so that ``rollback`` can undo up to B tokens."""
        rows = new_rows or _standalone
        layers = [LayerCache(slots[("window", i)]) for i in range(cfg.num_hidden_layers)]
        for (name, i), plan in v4_compressors(cfg).items():
            state = CompressorState((name, i), slots[(name, i, "kv")], slots[(name, i, "score")], plan, rows)
            setattr(layers[i], "compressor" if name == "comp" else "indexer", state)
        mtp = MTPState(LayerCache(slots[MTP_WINDOW]), slots[MTP_STREAMS]) if MTP_WINDOW in slots else None
        return cls(layers, slots, backtrack=backtrack, mtp=mtp)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens (rejected drafts), at most B: the state becomes exactly that
        of a cache that never ran them."""
        if not num_tokens:
            return
        check_rollback(num_tokens, self.backtrack)
        old, new = self.seq_len, self.seq_len - num_tokens
        for lc in self.layers:
            lc.window.rollback(num_tokens)
        for state in self._states():
            state.rollback(old, new)
        for ring in self.dspark_ctx.values():
            ring.rollback(max(self.ctx_end - new, 0))
        self.ctx_end = min(self.ctx_end, new)
        self.seq_len = new

    def _states(self):
        for lc in self.layers:
            yield from (s for s in (lc.compressor, lc.indexer) if s is not None)

    @functools.cached_property
    def compressor_states(self) -> list[CompressorState]:
        """The compressor states in ``v4_compressors`` order, built once (the objects never change): what a planned
        decode step reads of this request besides its slot's rings."""
        return list(self._states())

    @functools.cached_property
    def step_stores(self) -> list[RowStore]:
        """Each compressor state's paged store, in ``compressor_states`` order, made once (a state keeps its store
        for life): what a planned decode step appends to."""
        return [s.store() for s in self.compressor_states]

    def release(self) -> None:
        """Give the slot back (the request finished or was preempted)."""
        self.slots.release()

    def snapshot(self) -> CacheSnapshot:
        """The slot copied into a snapshot slot; entries by (ratio, length) only (they stay in the pool)."""
        lengths = {s.key: (s.ratio, s.num_entries) for s in self._states() if s.entries is not None}
        meta = {
            "seq_len": self.seq_len,
            "ctx_end": self.ctx_end,
            "mtp_seq_len": None if self.mtp is None else self.mtp.seq_len,
        }
        return CacheSnapshot(self.slots.copy_to("snapshot"), meta, lengths)

    @classmethod
    def restore(
        cls, cfg: DeepseekV4Config, snap: CacheSnapshot, new_rows: RowFactory, backtrack: int = 0
    ) -> SequenceCache:
        """A cache continuing from ``snap`` in a new request slot, its entry stores resumed at their lengths."""
        cache = cls.empty(cfg, snap.slots.copy_to("request"), new_rows, backtrack)
        cache.seq_len, cache.ctx_end = snap.meta["seq_len"], snap.meta["ctx_end"]
        if cache.mtp is not None:
            cache.mtp.seq_len = snap.meta["mtp_seq_len"]
        for state in cache._states():
            if state.key in snap.lengths:
                state.store().resume(snap.lengths[state.key][1])
        return cache

"""DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``), text model and DSpark draft head, from the
deepinfer-kernels ops. The incremental path: per-request caches, chunked prefill, decode, YOCO truncation.

Reading order: Engram -> attention (window, compressor, indexer) -> MoE -> block -> DSpark -> model.
``deepseek_v41_reference.py`` is the slow full-recompute definition of correct; both call the same
row-invariant primitives defined here, so they agree bitwise in float32.

Parameter names are the released checkpoint's (``layers.2.attn.compressor.wgate.weight``), except that
routed experts are stacked (``ffn.experts.w13`` / ``.w2``) and Engram tables keep their stored format
(``engram.rows`` FP8 or bf16 + ``engram.scale`` E8M0) and are dequantised per gathered row.

Numerics (model_v41_decisions.md, oracle_notes.md): norms, RoPE, mHC, router, SwiGLU in fp32; ratio-2
compressor projections in fp32, ratio-1 in the model dtype; LM head in fp32. The model's trained
quantisers are applied where the caches store them (window KV FP8/32 UE8M0; compressed KV E2M1/16 with
E4M3 scales; index keys and indexer queries E2M1/32 UE8M0); ``fake_quant=False`` turns them into the
identity (tests that separate logic errors from rounding flips).

YOCO (decisions Y1-Y5): layers >= ``n_prefill_layer`` are the decoder. During a prefill chunk with
truncation ``mask`` or ``compact`` and floor f = L - keep (L = prompt length), decoder rows see window
keys in [max(p - W + 1, f), p]; ``compact`` also skips decoder rows p < f (their logits are NaN), while
the boundary layer's compressor still consumes every row.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from deepinfer_kernels import (
    candidate_block_mask,
    engram_gate_inject,
    engram_gather_rows,
    engram_hash_ids,
    engram_next_history,
    engram_rows_in_place,
    fake_quant_e2m1,
    fake_quant_fp8_ue8m0,
    grouped_linear,
    indexer_scores,
    indexer_scores_paged,
    indexer_topk,
    kv_compress_pool,
    kv_compress_pool_rows,
    linear,
    mhc_collapse,
    mhc_initial_pre_mix,
    moe_route_topk,
    rope_interleaved,
    rope_inv_freq,
    without_early_launch,
)
from deepinfer_kernels.ops.engram import engram_multipliers
from torch import nn

from deepinfer_runtime.cache_layout import CacheKind, CacheLayout
from deepinfer_runtime.cuda_graphs import StepGraphs, SublayerGraphs, attach_sublayer_graphs
from deepinfer_runtime.decode_batch import DecodeBatch, paged_stores
from deepinfer_runtime.host_copy import long_tensor
from deepinfer_runtime.kv_pool import RowStore, TensorRows
from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config
from deepinfer_runtime.models.layers import (
    Experts,
    Linear,
    MhcBlock,
    Norm,
    SharedExpert,
    attention_rotated_back,
    draft_block_inputs,
    draft_block_key_ids,
    embed_streams,
    param,
    project,
    routed_plus_shared,
)
from deepinfer_runtime.models.side_stream import SideStream
from deepinfer_runtime.slot_pool import (
    CacheSnapshot,
    Ring,
    SlotPool,
    SlotSpec,
    SlotState,
    append_window,
    check_rollback,
)

# A planned decode step's candidate blocks (the candidate source's mask for the re-index layers after it) on a lane
# of their own ("candidates"), beside the source's top-k and everything up to the first re-index layer, instead of
# before the top-k on the index lane (at 32K a block top-k of ~15 us plus three small kernels, all on the source's
# critical path). The same bits either way. H200, pipelined ms at 32K tokens, two alternating rounds in one lease
# (``benchmarks/ab_slice.py``, session 24): batch 1 2.381 -> 2.376, batch 8 5.273 -> 5.249.
CANDIDATE_LANE = True
# Index layers' decode: the q up-projection launched without programmatic dependent launch, so that the index scores
# forked beside it get SMs first instead of waiting for the whole stream (``deepseek_v4.INDEX_LANE_FIRST``). H200,
# pipelined ms, two alternating rounds in one lease (session 25): batch 1 2.342 -> 2.331 (4K), 2.368 -> 2.358 (32K).
INDEX_LANE_FIRST = True
# Each mHC site's expand also makes the next site's sublayer input (``mhc_expand_collapse`` + the next norm, in
# place of ``mhc_collapse_rms_norm`` reading the new streams back): the FFN site's always, the next layer's unless
# an Engram gate changes the streams in between (``Block.run_chained``). The same bits for bf16 streams. At prefill
# sizes the collapse's read of the streams is 4x the [T, d] traffic of its output (8K prefill, H100, session 37:
# 18 collapse + norm launches 2.8 ms). Off until timed on a GPU (session 39 had no device).
EXPAND_COLLAPSE = False
TRUNCATION_MODES = ("off", "mask", "compact")


# ----------------------------------------------------------------------------------------------------------
# Per-request state
# ----------------------------------------------------------------------------------------------------------
@dataclass
class SourceState:
    """What a KV source publishes: entries [N, D] (RoPE'd, quantised) and index keys [N, Dh] as row
    stores (``kv_pool``), and for ratio > 1 the rings of the fp32 projections (kv, score) [ratio + B, D] by
    position: the incomplete group (positions num_entries * ratio ..), the newest row and B rows for rollback."""

    entries: RowStore
    keys: RowStore
    ratio: int
    kv: Ring | None = None
    score: Ring | None = None

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def rollback(self, old_len: int, new_len: int) -> None:
        """Forget the rows fed after ``new_len`` (of ``old_len``): entries and keys of groups that are no
        longer complete; the incomplete group's projections stay in the rings."""
        r, n = self.ratio, new_len // self.ratio
        self.entries.truncate(n)
        self.keys.truncate(n)
        if r == 1:
            return
        if n * r < self.kv.lo:
            raise RuntimeError(f"rollback to {new_len} needs projections from {n * r}; the ring starts at {self.kv.lo}")
        self.kv.rollback(old_len - new_len)
        self.score.rollback(old_len - new_len)


def v41_slot_specs(cfg: DeepseekV41Config, dtype: torch.dtype, backtrack: int = 0) -> list[SlotSpec]:
    """The fixed buffers of one request: window rings [W + B, D] per layer and DSpark context rings [W + B, D] per
    stage in ``dtype``; projection rings (kv, score) [ratio + B, D] fp32 per ratio > 1 KV source; the Engram
    lookback [n - 1, 1] int64 (compressed ids) when the model has Engram layers. A ring keeps the newest row too
    (W, not W - 1; ratio, not ratio - 1) so that a planned decode step reads it in place after its write."""
    w, d, b = cfg.sliding_window, cfg.head_dim, backtrack
    specs = [SlotSpec(("window", i), "window latents", w + b, d, dtype) for i in range(cfg.num_hidden_layers)]
    for src in cfg.kv_source_layer_ids:
        r = cfg.compress_ratio(src)
        if r > 1:
            tail = "compressor tails (fp32)"
            specs += [SlotSpec((part, src), tail, r + b, d, torch.float32) for part in ("kv", "score")]
    if cfg.engram_layer_ids:
        specs.append(SlotSpec(("engram",), "Engram lookback", cfg.engram_max_ngram_size - 1, 1, torch.int64))
    specs += [SlotSpec(("dspark", k), "DSpark context", w + b, d, dtype) for k in range(cfg.num_nextn_predict_layers)]
    return specs


@dataclass
class V41SequenceCache:
    """One request's state: window rings per layer, source states, Engram lookback, DSpark context rings.

    The fixed-size state lives in ``slots`` (a slot of a ``slot_pool.SlotPool`` made from ``v41_slot_specs``):
    windows[l]: ring [W + B, D] of layer l's window latents by position (the W - 1 a query attends to before
    its own position, its own, B more for rollback); in compact YOCO mode decoder layers hold only rows at or after the
    floor. dspark_ctx[s]: ring [W + B, D] of DSpark stage-s context keys (positions .. ctx_end - 1).
    engram_history: [1, n - 1] compressed ids of the last positions (None before the first chunk).
    new_rows(key, ratio) makes the growing stores: standalone tensors by default, pool pages in the engine.
    """

    slots: SlotState
    sources: dict[int, SourceState] = field(default_factory=dict)
    ctx_end: int = 0
    seq_len: int = 0
    new_rows: Callable[[object, int], RowStore] = field(default=lambda key, ratio: TensorRows(), repr=False)
    backtrack: int = 0  # B: tokens a speculative step may roll back; rings keep B rows beyond their need
    has_history: bool = False  # the Engram lookback has been written

    def __post_init__(self):
        rings = self.slots.rings
        self.windows = {key[1]: ring for key, ring in rings.items() if key[0] == "window"}
        self.dspark_ctx = {key[1]: ring for key, ring in rings.items() if key[0] == "dspark"}

    @property
    def engram_history(self) -> torch.Tensor | None:
        if not self.has_history or ("engram",) not in self.slots:
            return None
        return self.slots[("engram",)].buf.view(1, -1)

    @engram_history.setter
    def engram_history(self, history: torch.Tensor) -> None:
        """Store the lookback [1, n - 1] in the slot (the model computes it with ``engram_next_history``)."""
        if ("engram",) in self.slots:
            self.slots[("engram",)].buf.view(1, -1).copy_(history)
        self.has_history = True

    def source(self, layer: int, ratio: int) -> SourceState:
        src = self.sources.get(layer)
        if src is None:
            entries, keys = self.new_rows(("kv", layer), ratio), self.new_rows(("idx", layer), ratio)
            kv, score = (self.slots[("kv", layer)], self.slots[("score", layer)]) if ratio > 1 else (None, None)
            src = self.sources[layer] = SourceState(entries, keys, ratio, kv, score)
        return src

    def release(self) -> None:
        """Give the slot back (the request finished or was preempted)."""
        self.slots.release()

    def snapshot(self) -> CacheSnapshot:
        """The slot copied into a snapshot slot; growing stores by length only (their rows stay in the shared
        pool blocks the prefix cache keeps)."""
        meta = {"ctx_end": self.ctx_end, "seq_len": self.seq_len, "has_history": self.has_history}
        lengths = {k: (s.ratio, len(s.entries)) for k, s in self.sources.items()}
        return CacheSnapshot(self.slots.copy_to("snapshot"), meta, lengths)

    @classmethod
    def restore(
        cls, snap: CacheSnapshot, new_rows: Callable[[object, int], RowStore], backtrack: int = 0
    ) -> V41SequenceCache:
        """A cache continuing from ``snap`` in a new request slot, its growing stores resumed at their lengths."""
        cache = cls(snap.slots.copy_to("request"), new_rows=new_rows, backtrack=backtrack, **snap.meta)
        for layer, (ratio, n) in snap.lengths.items():
            src = cache.source(layer, ratio)
            src.entries.resume(n)
            src.keys.resume(n)
        return cache

    def rollback(self, num_tokens: int, engram_history: torch.Tensor | None) -> None:
        """Undo the last ``num_tokens`` tokens (rejected drafts), at most ``backtrack`` of them: the state
        becomes exactly that of a cache that never ran them. ``engram_history`` is the lookback of the
        kept sequence (the model recomputes it from the token ids)."""
        if not num_tokens:
            return
        check_rollback(num_tokens, self.backtrack)
        old, new = self.seq_len, self.seq_len - num_tokens
        for ring in self.windows.values():
            ring.rollback(num_tokens)
        for src in self.sources.values():
            src.rollback(old, new)
        for ring in self.dspark_ctx.values():
            ring.rollback(max(self.ctx_end - new, 0))
        self.ctx_end = min(self.ctx_end, new)
        self.engram_history, self.seq_len = engram_history, new


@dataclass
class StepRows:
    """The rows of one request inside a token-flat step (rows = slice into the flat tensors)."""

    rows: slice
    positions: torch.Tensor  # [S] absolute positions
    cache: V41SequenceCache
    yoco_floor: int | None  # decoder window floor for this prefill chunk (None: no truncation)
    start: int  # positions[0] as a host int (reading it from the device would be a sync)


def _kept_rows(steps: list[StepRows], dev) -> tuple[torch.Tensor, list[StepRows], list[int]]:
    """Compact YOCO: the flat ids of the rows at or after each request's floor (a suffix of its chunk), the
    re-sliced steps, and each flat row's index among the kept rows (-1: dropped). Built on the host."""
    keep, kept, where, start = [], [], [], 0
    for st in steps:
        n = st.rows.stop - st.rows.start
        skip = min(max((st.yoco_floor or 0) - st.start, 0), n)
        keep += range(st.rows.start + skip, st.rows.stop)
        where += [-1] * skip + list(range(start, start + n - skip))
        kept.append(
            StepRows(slice(start, start + n - skip), st.positions[skip:], st.cache, st.yoco_floor, st.start + skip)
        )
        start += n - skip
    return long_tensor(keep, dev), kept, where


# ----------------------------------------------------------------------------------------------------------
# Engram
# ----------------------------------------------------------------------------------------------------------
class Engram(nn.Module):
    """n-gram hash memory (spec 5): 24 table rows per token -> keys for 4 streams + one value, gated in.

    The table stays in its stored format (FP8 rows + E8M0 per-32 scales, or bf16) on ``table_device`` and
    only the gathered rows are dequantised, so a 100 GB table can live in (pinned) host memory.
    """

    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.index = cfg.engram_layer_ids.index(layer)
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.head_dim, self.hidden, self.hc = cfg.engram_head_dim, cfg.hidden_size, cfg.hc_mult
        self.wkv = Linear(n_cols * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.hidden_size, dtype)
        self.q_weight = param(cfg.hc_mult, cfg.hidden_size, dtype=torch.float32)
        self.k_weight = param(cfg.hc_mult, cfg.hidden_size, dtype=torch.float32)
        self.rows: torch.Tensor | None = None  # [R, head_dim] float8_e4m3fn or float
        self.scale: torch.Tensor | None = None  # [R, head_dim / 32] float8_e8m0fnu or None
        # (lo, hi, whole-table rows) when a rank's loader read only rows [lo, hi) (engram_shard.py serves lookups)
        self.row_range: tuple[int, int, int] | None = None
        primes = cfg.engram_primes[self.index]
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.long), persistent=False)
        mult = engram_multipliers(layer, cfg.engram_compressed_vocab_size, cfg.engram_max_ngram_size)
        self.register_buffer("multipliers", torch.tensor(mult, dtype=torch.long), persistent=False)

    def set_table(
        self, rows: torch.Tensor, scale: torch.Tensor | None, row_range: tuple[int, int, int] | None = None
    ) -> None:
        self.rows, self.scale, self.row_range = rows, scale, row_range

    def gather(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """ids [T, C] row ids -> dequantised rows [T, C * head_dim]."""
        if self.row_range is not None:
            raise RuntimeError(f"Engram: holds rows {self.row_range[:2]} of the table only; lookups need sharding")
        return engram_gather_rows(self.rows, self.scale, ids.to(device), dtype)

    def in_place(self, device: torch.device) -> bool:
        """Lookups from ``device`` need no host sync (the table is there, or pinned and read in place): a step
        that makes them can be captured in a CUDA graph."""
        return self.row_range is None and engram_rows_in_place(self.rows, device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, n, d] streams, ids [T, 24] -> streams with the gated value added (fp32 gate)."""
        return self.inject(x, self.values(ids, x.dtype, x.device))

    def values(self, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """ids [T, 24] -> keys and value [T, n + 1, d] in ``dtype``: the part that reads token ids only."""
        return self.wkv(self.gather(ids, dtype, device)).view(-1, self.hc + 1, self.hidden)

    def inject(self, x: torch.Tensor, kv: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, n, d] streams and ``values`` [T, n + 1, d] -> streams with the gated value added. ``w``:
        ``gate_weight()``, made already (a decode step makes it beside the layers, with the values)."""
        w = self.gate_weight() if w is None else w
        return engram_gate_inject(x, kv[:, : self.hc], kv[:, self.hc], w, None)

    def gate_weight(self) -> torch.Tensor:
        """The gate's fp32 product of its query and key norm weights [n, d] (weights only)."""
        return self.q_weight.float() * self.k_weight.float()


# ----------------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """KV-source compressor: ratio 2 pools token pairs with a softmax gate (fp32), ratio 1 projects each token."""

    def __init__(self, cfg: DeepseekV41Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim, dtype)
        if ratio > 1:
            self.wgate = Linear(cfg.hidden_size, cfg.head_dim, dtype)
        self.norm = Norm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Ratio 2: fp32 (kv, score) per token; ratio 1: the normed latent per token (model dtype)."""
        return self.projected(
            [m(x) if dt is None else linear(x, m.weight, out_dtype=dt) for m, dt in zip(*self.projections())]
        )

    def projections(self) -> tuple[list[Linear], list[torch.dtype | None]]:
        """``project``'s matrix products of x, with their out dtypes (``projected`` finishes them)."""
        if self.ratio == 1:
            return [self.wkv], [None]
        return [self.wkv, self.wgate], [torch.float32, torch.float32]

    def projected(self, ys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``project`` from the products ``projections`` lists (made by the caller with its own)."""
        return (self.norm(ys[0]), None) if self.ratio == 1 else (ys[0], ys[1])

    def pool(self, kv: torch.Tensor, score: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """kv, score [G, ratio, D] fp32 -> normed latents [G, D] in ``dtype``."""
        return self.norm(kv_compress_pool(kv, score).to(dtype))

    def pool_rows(self, kv: torch.Tensor, score: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``pool`` of groups read in place: kv, score [N, D] fp32 row tables, rows [G, ratio] ids (-1 empty)."""
        return self.norm(kv_compress_pool_rows(kv, score, rows, 0, kv.shape[-1], out_dtype=dtype))


def pad_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """ids [S, k] (k <= width) padded with -1 to [S, width]; as they are when k = width (F.pad would copy them: a
    launch on every decode step once the context holds index_topk entries)."""
    return ids if ids.shape[1] == width else F.pad(ids, (0, width - ids.shape[1]), value=-1)


class Indexer(nn.Module):
    """Index-source indexer: queries (+ keys on KV sources) and the per-head weights."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        if cfg.has_compressor(layer):
            self.wk = Linear(cfg.head_dim, self.head_dim, dtype)
            self.k_norm = Norm(self.head_dim, cfg.rms_norm_eps)


class Attention(nn.Module):
    """Window attention plus, on ratio > 0 layers, the selected entries of the layer's KV source (spec 3)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype, fake_quant: bool):
        super().__init__()
        self.cfg, self.layer, self.fake_quant = cfg, layer, fake_quant
        self.ratio = cfg.compress_ratio(layer)
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = Norm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = Norm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = param(self.n_heads, dtype=torch.float32)
        is_stage = layer >= cfg.num_hidden_layers
        self.kv_source = None if is_stage or self.ratio == 0 else cfg.kv_source_of(layer)
        self.index_source = None if is_stage or self.ratio == 0 else cfg.index_source_of(layer)
        if self.kv_source == layer:
            self.compressor = Compressor(cfg, self.ratio, dtype)
        if self.index_source == layer:
            self.indexer = Indexer(cfg, layer, dtype)
        cand = cfg.candidate_source_layer_id
        self.is_candidate_source = cand is not None and layer == cand
        # re-index layers reading the candidate source's KV restrict their top-k to its candidate blocks
        self.uses_candidates = (
            cand is not None and self.index_source == layer and self.kv_source == cand and layer != cand
        )
        base = cfg.rope_theta if self.ratio == 0 else cfg.compress_rope_theta
        yarn = None if self.ratio == 0 else cfg.yarn
        self.register_buffer("inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, base, yarn), persistent=False)

    # --- row-invariant primitives, shared with the reference model -------------------------------------
    def query(self, x: torch.Tensor, pos: torch.Tensor, xa=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, d] -> (q_lat [S, q_lora_rank], q [S, H, D] rotated). V4.1 has no per-head q norm. ``xa``: x
        wq_a^T when the caller made it already."""
        qr = self.q_norm(self.wq_a(x) if xa is None else xa)
        return qr, self.query_up(qr, pos)

    def query_up(self, qr: torch.Tensor, pos: torch.Tensor, early: bool = True) -> torch.Tensor:
        """qr [S, q_lora_rank] -> rotated queries [S, H, D]. ``early`` False: the up-projection is launched without
        programmatic dependent launch (``without_early_launch``), for the index lane beside it to find SMs."""
        with without_early_launch(not early):
            q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        return rope_interleaved(q, pos, self.inv_freq, out=q)  # in place: only the rotated channels move

    def window_kv(self, x: torch.Tensor, pos: torch.Tensor, xkv=None) -> torch.Tensor:
        """x [S, d] -> window latents [S, D]: norm, RoPE, FP8 (block 32, UE8M0) as stored (``xkv``: x wkv^T, made
        already)."""
        kv = self.kv_norm.rope(self.wkv(x) if xkv is None else xkv, pos, self.inv_freq)
        return fake_quant_fp8_ue8m0(kv, 32) if self.fake_quant else kv

    def publish(self, latent: torch.Tensor, group_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE compressed latents [G, D] at their first-token positions -> (entries, index keys)."""
        entry = rope_interleaved(latent, group_pos, self.inv_freq)
        ix = self.indexer
        key = ix.k_norm.rope(ix.wk(latent), group_pos, self.inv_freq)
        if self.fake_quant:
            entry, key = fake_quant_e2m1(entry, 16, "e4m3"), fake_quant_e2m1(key, 32, "ue8m0")
        return entry, key

    def index_query(self, x, qr: torch.Tensor, pos: torch.Tensor, xw=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, d], qr [S, q_lora_rank] at ``pos`` -> (the indexer's post-RoPE queries [S, H, Dh], FP4-simulated
        where the model quantises, and head weights [S, H] fp32 with the 1/sqrt(H) scale). ``xw``: x
        weights_proj^T when the caller made it already (x is then not read)."""
        return self.index_rotated_query(qr, pos), self.index_weights(self.indexer.weights_proj(x) if xw is None else xw)

    def index_rotated_query(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ix = self.indexer
        qi = ix.wq_b(qr).view(-1, ix.n_heads, ix.head_dim)
        qi = rope_interleaved(qi, pos, self.inv_freq, out=qi)
        return fake_quant_e2m1(qi, 32, "ue8m0") if self.fake_quant else qi

    def index_weights(self, xw: torch.Tensor) -> torch.Tensor:
        """x weights_proj^T [S, H] -> the indexer's head weights [S, H] fp32, scaled by 1/sqrt(H)."""
        return xw.float() * self.indexer.n_heads**-0.5

    def index_scores(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor):
        """Indexer scores [S, N] fp32 of this index source's queries against ``keys`` [N, Dh]; -inf past each query's
        visible entries (``select`` and ``candidates`` treat those as invisible anyway; they are not computed)."""
        qi, weights = self.index_query(x, qr, pos)
        visible = ((pos + 1) // self.ratio)[None]
        return indexer_scores(qi[None], keys[None], weights[None], self.indexer.head_dim**-0.5, visible)[0]

    def select(self, scores: torch.Tensor, pos: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        """Top-k entry ids [S, index_topk] (ascending, -1 padded to a fixed width) among visible entries."""
        visible = ((pos + 1) // self.ratio)[None]
        picked = indexer_topk(scores[None], visible, self.indexer.topk, None if cand is None else cand[None])[0]
        return pad_ids(picked, self.indexer.topk)

    def candidates(self, scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        visible = ((pos + 1) // self.ratio)[None]
        cfg = self.cfg
        return candidate_block_mask(scores[None], visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)[0]

    def window_ids(self, pos: torch.Tensor, first: int, floor: int | None) -> torch.Tensor:
        """Row ids [S, W] into a window buffer whose row 0 holds position ``first``; -1 where invisible."""
        key_pos = pos[:, None] - self.window + 1 + torch.arange(self.window, device=pos.device)
        low = 0 if floor is None else floor
        return torch.where(key_pos >= max(low, first), key_pos - first, -1)

    def attend(self, q, kv_rows, entries, win_ids, picked, pos) -> torch.Tensor:
        """Softmax with sinks over [window | selected entries], inverse RoPE, grouped output -> [S, d]. ``picked``
        [S, K] int64: rows of ``entries`` (-1: none)."""
        if entries is None:
            return self.attend_rows(q, kv_rows, win_ids, pos)
        # two segments: [window rows | entries]
        idx = torch.cat([win_ids, torch.where(picked >= 0, picked + kv_rows.shape[0], -1)], dim=1)
        return self.attend_rows(q, (kv_rows, entries.to(kv_rows.dtype)), idx, pos)

    def attend_rows(self, q, kv, idx, pos) -> torch.Tensor:
        """``attend`` over the rows ``idx`` [S, K] int64 (-1: none) of ``kv`` (one tensor, or two segments read as
        one row table, as ``sparse_mqa_attention`` takes them) -> [S, d]."""
        o = attention_rotated_back(q, kv, idx, self.attn_sink, self.head_dim**-0.5, pos, self.inv_freq)
        o = grouped_linear(o.reshape(o.shape[0], self.cfg.o_groups, -1), self.wo_a.weight)
        return self.wo_b(o.flatten(1))

    # --- incremental driver ------------------------------------------------------------------------------
    def feed_compressor(self, x: torch.Tensor, pos: torch.Tensor, src: SourceState) -> None:
        """Append the chunk's rows to this KV source; publish every completed group."""
        kv, score = self.compressor.project(x)
        r = self.ratio
        if r == 1:
            latent, group_pos = kv, pos
        else:
            # the source is fed every row in order: the chunk follows the rings' end
            start, group_start = src.kv.end, src.num_entries * r
            held_kv, held_score = src.kv.read(group_start, start), src.score.read(group_start, start)
            src.kv.write(start, kv)  # after the reads: a long chunk overwrites the ring
            src.score.write(start, score)
            kv, score = torch.cat([held_kv, kv]), torch.cat([held_score, score])
            usable = kv.shape[0] // r * r
            if not usable:
                return
            latent = self.compressor.pool(
                kv[:usable].view(-1, r, kv.shape[-1]), score[:usable].view(-1, r, kv.shape[-1]), x.dtype
            )
            group_pos = (torch.arange(latent.shape[0], device=x.device) + src.num_entries) * r
        entry, key = self.publish(latent, group_pos)
        src.entries.append(entry)
        src.keys.append(key)

    def forward_chunk(self, x, x_comp, pos, pos_comp, cache: V41SequenceCache, floor, shared: dict, start: int):
        """One request's rows: x [S, d] normed inputs at ``pos`` (``start`` = pos[0] as a host int); x_comp /
        pos_comp the compressor's rows (all rows of the chunk, also in compact YOCO mode). ``shared`` carries
        top-k / candidates from sources to consumers within this step."""
        if self.kv_source == self.layer:
            self.feed_compressor(x_comp, pos_comp, cache.source(self.layer, self.ratio))
        if not pos.numel():  # compact YOCO: no decoder rows of this request in this chunk
            return x.new_zeros(0, self.cfg.hidden_size)
        qr, q = self.query(x, pos)
        rows, first = self.append_window(cache, self.window_kv(x, pos), start)
        return self.attend_cached(x, qr, q, rows, first, pos, floor, cache, shared)

    def append_window(self, cache: V41SequenceCache, kv: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """Append window latents kv [S, D] of positions start.. to the cache's window ring: returns the rows [held
        window rows | kv] the queries attend over and the position of their row 0. The ring keeps the last W rows
        (a query's W - 1 and its own), and B more to roll back into (speculative decoding):
        ``slot_pool.append_window``."""
        return append_window(cache.windows[self.layer], kv, self.window, start)

    def attend_cached(self, x, qr, q, rows, first: int, pos, floor, cache: V41SequenceCache, shared: dict):
        """Queries of rows x [S, d] (qr, q from ``query``) at ``pos`` against window ``rows`` (row 0 at position
        ``first``) and the compressed entries their index source selects (computed here on index sources)."""
        if self.ratio == 0:
            return self.attend(q, rows, None, self.window_ids(pos, first, floor), None, pos)
        src = cache.sources[self.kv_source]
        entries = src.entries.view()
        entries = entries if entries is not None else x.new_zeros(0, self.head_dim)
        if self.index_source == self.layer:
            keys = src.keys.view()
            keys = keys if keys is not None else x.new_zeros(0, self.cfg.index_head_dim)
            scores = self.index_scores(x, qr, pos, keys)
            cand = shared.get("candidates") if self.uses_candidates else None
            if self.is_candidate_source:
                shared["candidates"] = self.candidates(scores, pos)
            shared[("topk", self.layer)] = self.select(scores, pos, cand)
        picked = shared[("topk", self.index_source)]
        return self.attend(q, rows, entries, self.window_ids(pos, first, floor), picked, pos)

    # --- planned decode step (decode_batch) --------------------------------------------------------------
    def forward_decode(self, x: torch.Tensor, batch: DecodeBatch, shared: dict) -> torch.Tensor:
        """``forward_chunk`` for every request of a planned decode step at once (one row each, no YOCO floor):
        x [rows, d] -> [rows, d]. ``shared`` carries top-k / candidates [rows, .] between layers of the step."""
        pos = batch["pos"]
        index = self.index_source == self.layer
        key = ("kv", self.kv_source)  # the entries are read in place, from the pool
        proj = project(x, *self.projections())
        side = SideStream.of(x.device)
        # beside the query path, what nothing on it reads before the join: the compressor (ring writes, entry
        # pools) and the window's latents with their ring write and row table (the window on a lane of its own, for
        # the index scores to wait on the compressor alone as V4's do, measured no faster in session 15); a layer
        # that reads an earlier layer's picks makes its row table [window rows | pool rows of the picks] there too
        with side.branch():
            if index:  # the head weights, read by the index scores
                weights = self.index_weights(proj[-1])
            if self.kv_source == self.layer:
                self.feed_compressor_decode(self.compressor.projected(proj[2:]), x.dtype, batch)
            kv_rows, win_ids = batch.window(("window", self.layer), self.window_kv(x, pos, xkv=proj[1]))
            if self.ratio and not index:
                rows = batch.pool_rows(
                    key, shared[("topk", self.index_source)], offset=kv_rows.shape[0], prefix=win_ids
                )
        qr = self.q_norm(proj[0])
        if index:
            # the index query streams its (smaller) weight first; the scores, the candidates, the top-k and the row
            # table then run on the index lane beside the q up-projection, which used to run first, so that the
            # top-k (15-65 us at 32K) started after both streams
            qi = self.index_rotated_query(qr, pos)
            lane = SideStream.of(x.device, "index")
            with lane.branch():
                side.depend()  # the index keys, the head weights and the window rows
                picked = self.pick_decode(qi, weights, batch, shared)
                rows = batch.pool_rows(key, picked, offset=kv_rows.shape[0], prefix=win_ids)
        q = self.query_up(qr, pos, early=not index or not INDEX_LANE_FIRST)
        side.join()
        if index:
            lane.join()
        if self.ratio == 0:
            return self.attend(q, kv_rows, None, win_ids, None, pos)
        kv = (kv_rows, batch.kv[key].flat.to(kv_rows.dtype))
        return self.attend_rows(q, kv, rows, pos)

    def pick_decode(self, qi: torch.Tensor, weights: torch.Tensor, batch: DecodeBatch, shared: dict) -> torch.Tensor:
        """An index source's picks for a planned decode step, from its rotated queries qi [rows, Hi, Dh] and head
        weights [rows, Hi] fp32: the scores against every request's index keys (read in place), the candidate
        blocks where this layer makes them (stored in ``shared`` for the layers that use them), the top-k ->
        entry ids [rows, index_topk] (-1 padded), also stored in ``shared``."""
        pool, tables = batch.pages(("idx", self.kv_source))
        scores = indexer_scores_paged(qi[:, None], pool, tables, weights[:, None], self.indexer.head_dim**-0.5)
        visible = batch[("visible", self.ratio)][:, None]
        cand = None
        if self.uses_candidates:
            cand = shared.get("candidates")
            if CANDIDATE_LANE:  # made on their own lane: this lane waits for them (the main path joins at the end)
                SideStream.of(qi.device, "candidates").depend()
        if self.is_candidate_source:
            cfg = self.cfg
            lane = SideStream.of(qi.device, "candidates") if CANDIDATE_LANE else None
            with lane.branch() if lane is not None else contextlib.nullcontext():
                shared["candidates"] = candidate_block_mask(
                    scores, visible, cfg.candidate_block_size, cfg.candidate_topk_blocks
                )
            if lane is not None:
                shared["candidate_inputs"] = (scores, visible)  # read on that lane: alive until its join
        picked = pad_ids(indexer_topk(scores, visible, self.indexer.topk, cand)[:, 0], self.indexer.topk)
        shared[("topk", self.layer)] = picked
        return picked

    def projections(self) -> tuple[list[Linear], list[torch.dtype | None]]:
        """Every projection of the normed input x a decode step makes, with its out dtype: wq_a, wkv, then on a KV
        source the compressor's (``Compressor.projections``), last on an index source the indexer's weights_proj.
        ``forward_decode`` makes them in one ``project`` call (one launch at decode sizes)."""
        lins, dts = [self.wq_a, self.wkv], [None, None]
        if self.kv_source == self.layer:
            more, more_dts = self.compressor.projections()
            lins, dts = lins + more, dts + more_dts
        if self.index_source == self.layer:
            lins, dts = lins + [self.indexer.weights_proj], dts + [None]
        return lins, dts

    def feed_compressor_decode(self, projected, dtype: torch.dtype, batch: DecodeBatch) -> None:
        """``feed_compressor`` of one row per request, from ``Compressor.projected`` of the step's rows (latents
        in ``dtype``): every row publishes the group ending at it; the plan keeps the entries of the requests that
        complete one. A group is pooled from the rings in place, by the requests that complete it (the others'
        rows are empty: NaN entries, stored in the scratch row)."""
        kv, score = projected
        r, latent = self.ratio, kv
        if r > 1:
            kv_table, score_table = batch.write(("kv", self.layer), kv), batch.write(("score", self.layer), score)
            rows = batch.ring_ids(("kv", self.layer), r, every=r)
            latent = self.compressor.pool_rows(kv_table, score_table, rows, dtype)
        entry, key = self.publish(latent, batch[("group_start", r)])  # ratio 1: the row's own position
        batch.append(("kv", self.layer), entry)
        batch.append(("idx", self.layer), key)


# ----------------------------------------------------------------------------------------------------------
# MoE and block
# ----------------------------------------------------------------------------------------------------------
class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.top_k = cfg, top_k
        self.weight = param(n_experts, cfg.hidden_size, dtype=dtype)
        self.bias = param(n_experts, dtype=torch.float32)
        self.bias_vl = param(n_experts, dtype=torch.float32)  # image-span tokens (vision: not built yet)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, out_dtype=torch.float32)
        if self.cfg.gate_temp != 1.0:  # (x / 1 is x: the released models' 1.0 costs no launch on the router chain)
            logits = logits / self.cfg.gate_temp
        return moe_route_topk(
            logits,
            self.bias,
            self.top_k,
            route_scale=self.cfg.routed_scaling_factor,
            scoring=self.cfg.scoring_func,
            norm_topk=self.cfg.norm_topk_prob and self.top_k > 1,
        )


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, n_experts: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, n_experts, top_k, dtype)
        self.experts = Experts(n_experts, cfg.moe_intermediate_size, cfg.hidden_size, dtype)
        self.shared_experts = SharedExpert(cfg.moe_intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor, split: bool = False):
        """x [T, d] -> [T, d]; ``split``: (routed, shared), whose sum that is (``routed_plus_shared``)."""
        return routed_plus_shared(x, lambda: self.gate(x), self.experts, self.shared_experts, self.limit, split)


class Block(MhcBlock):
    """Backbone layer or DSpark stage: [Engram] -> attention site -> FFN site, single-pass mHC (spec 6). With
    ``graphs`` (``cuda_graphs.SublayerGraphs``, set by ``enable_cuda_graphs``) the FFN site of short steps replays
    a CUDA graph."""

    graphs = None

    def __init__(
        self, cfg: DeepseekV41Config, layer: int, dtype: torch.dtype, fake_quant: bool, n_experts: int, top_k: int
    ):
        super().__init__(cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        d = cfg.hidden_size
        self.layer = layer
        self.attn_norm = Norm(d, cfg.rms_norm_eps)
        self.ffn_norm = Norm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, dtype, fake_quant)
        self.ffn = MoE(cfg, n_experts, top_k, dtype)
        if layer < cfg.num_hidden_layers and cfg.is_engram_layer(layer):
            self.engram = Engram(cfg, layer, dtype)

    def run(self, x, pre_mix, attn_fn):
        """x [T, n, d], pre_mix [T, n]; attn_fn(normed input [T, d]) -> [T, d]. The two sites of
        ``mhc_lagged_layer``, the FFN one through ``ffn_site``: (streams, the next layer's pre_mix)."""
        return self.run_chained(x, pre_mix, attn_fn)[:2]

    def run_chained(self, x, pre_mix, attn_fn, attn_input=None, next_norm=None):
        """``run`` in a chain of layers: (streams, the next layer's pre_mix, the next layer's attention input or
        None). ``attn_input``: this layer's, ``self.attn_norm.collapse(x, pre_mix)``, when the layer before made it;
        ``next_norm``: the next layer's attention norm, when nothing changes the streams between the two (no Engram
        there). With EXPAND_COLLAPSE each site's expand makes the next site's input (``site_beside``'s next_norm):
        the FFN site's here, and the next layer's when ``next_norm`` is given; without, the third item is None."""
        fuse = EXPAND_COLLAPSE
        x, pre, h = self.lagged_site(x, pre_mix, attn_fn, "attn", self.attn_norm, attn_input,
                                     self.ffn_norm if fuse else None)  # fmt: skip
        next_norm = next_norm if fuse else None
        fn = self.ffn_site if next_norm is None else partial(self.ffn_site, next_norm=next_norm)
        inputs = (x, pre) if h is None else (x, pre, h)
        if self.graphs is not None and self.graphs.applies(x):
            return self.graphs.run((self, next_norm is not None), fn, *inputs)
        return fn(*inputs)

    def ffn_site(self, x, pre, ffn_input=None, next_norm=None):
        """Streams x [T, n, d] and the attention site's pre [T, n] (and its ``ffn_input`` when the attention
        site's expand made it) -> (streams, the next layer's pre_mix, the next layer's attention input when
        ``next_norm`` is given, else None). Static shapes and no host reads: CUDA-graph safe."""
        return self.lagged_site(x, pre, lambda u: self.ffn(u, split=True), "ffn", self.ffn_norm, ffn_input, next_norm)

    def lagged_site(self, x, pre_mix, f, site: str, norm: Norm, sublayer_input=None, next_norm=None):
        """``mhc_lagged_site(x, pre_mix, f, self.mhc(site), self.hc, norm.fused)`` (the same ops, the same bits)
        with the site's coefficients on the side stream: they depend on x alone, and only the expand and the next
        site read them, so their latency-bound chain (mixes, Sinkhorn) runs beside the sublayer instead of before
        it. ``f`` takes the normed collapse (``sublayer_input`` when the site before made it) and returns the
        sublayer's output, or two addends of it (the expand adds them: ``mhc_expand``'s y_add). Returns (streams,
        pre, ``next_norm.collapse(streams, pre)`` or None)."""
        made = (lambda: sublayer_input) if sublayer_input is not None else (lambda: norm.collapse(x, pre_mix))
        return self.site_beside(x, site, made, f, next_norm=next_norm)


# ----------------------------------------------------------------------------------------------------------
# DSpark draft head
# ----------------------------------------------------------------------------------------------------------
@dataclass
class DraftBlock:
    """One drafted block per request: tokens [B, N], confidences [B, N] fp32, logprobs [B, N, V] fp32."""

    tokens: torch.Tensor
    confidences: torch.Tensor
    logprobs: torch.Tensor


class MarkovHead(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = param(cfg.vocab_size, cfg.dspark_markov_rank, dtype=dtype)
        self.head = Linear(cfg.dspark_markov_rank, cfg.vocab_size, dtype)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(cfg.hidden_size + cfg.dspark_markov_rank, 1, dtype)


class DSparkStage(Block):
    """One DSpark stage (spec 8 / decisions procedure D): a window-only block over the stage's context
    rows plus the block rows (non-causal inside the block)."""

    def __init__(self, cfg: DeepseekV41Config, stage: int, dtype: torch.dtype, fake_quant: bool):
        super().__init__(
            cfg,
            cfg.num_hidden_layers + stage,
            dtype,
            fake_quant,
            cfg.dspark_n_routed_experts,
            cfg.dspark_num_experts_per_tok,
        )
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, dtype)
            self.main_norm = Norm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = Norm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg, dtype)
            self.confidence_head = ConfidenceHead(cfg, dtype)

    def block_attention(self, x: torch.Tensor, *, pos: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x [N, d] normed block rows at ``pos``; ctx [C, D] context keys before pos[0] (C <= W)."""
        a = self.attn
        _, q = a.query(x, pos)
        kv = torch.cat([ctx, a.window_kv(x, pos)])
        n = x.shape[0]
        ids = draft_block_key_ids(a.window, ctx.shape[0], n, x.device)
        return a.attend(q, kv, None, ids[None].expand(n, -1), None, pos)


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------
def yoco_settings(mode: str | None, keep: int | None) -> tuple[str, int]:
    """Engine arguments win; otherwise DeepInfer's environment variables; otherwise compact / 140
    (DeepInfer's documented V4.1 serving default, decisions Y1-Y2)."""
    mode = mode if mode is not None else os.environ.get("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    if mode not in TRUNCATION_MODES:
        raise ValueError(
            f"YOCO truncation mode {mode!r} (DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE) must be one of {TRUNCATION_MODES}"
        )
    if keep is None:
        raw = os.environ.get("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "140")
        try:
            keep = int(raw)
        except ValueError:
            raise ValueError(f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS={raw!r} is not an integer") from None
    return mode, keep


class DeepseekV41ForCausalLM(nn.Module):
    """The V4.1-Flash text backbone (40 layers in the release) plus the DSpark draft head. Logits are fp32."""

    def __init__(
        self,
        cfg: DeepseekV41Config,
        dtype: torch.dtype = torch.bfloat16,
        fake_quant: bool = True,
        yoco_mode: str | None = None,
        yoco_keep_tokens: int | None = None,
        max_backtracking_tokens: int = 6,
    ):
        super().__init__()
        yoco_mode, yoco_keep_tokens = yoco_settings(yoco_mode, yoco_keep_tokens)
        if yoco_mode != "off" and yoco_keep_tokens < cfg.sliding_window + max_backtracking_tokens:
            raise ValueError(
                f"DEEPINFER_YOCO_PREFILL_KEEP_TOKENS / yoco_keep_tokens = {yoco_keep_tokens} must be >= sliding window "
                f"{cfg.sliding_window} + backtracking {max_backtracking_tokens} (decisions Y2)"
            )
        self.cfg, self.dtype, self.fake_quant = cfg, dtype, fake_quant
        self.yoco_mode, self.yoco_keep = yoco_mode, yoco_keep_tokens
        d = cfg.hidden_size
        self.embed = nn.Module()
        self.embed.weight = param(cfg.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(
            Block(cfg, i, dtype, fake_quant, cfg.n_routed_experts, cfg.num_experts_per_tok)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = Norm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size, dtype)
        self.mtp = nn.ModuleList(DSparkStage(cfg, s, dtype, fake_quant) for s in range(cfg.num_nextn_predict_layers))
        self.draft_method = "dspark" if len(self.mtp) else None
        self.step_graphs: StepGraphs | None = None  # set by enable_cuda_graphs
        self.register_buffer("engram_token_map", torch.zeros(cfg.vocab_size, dtype=torch.long), persistent=False)

    def enable_cuda_graphs(self, max_tokens: int = 64) -> SublayerGraphs:
        """Replay decode steps of at most ``max_tokens`` requests planned as one batch (``plan_decode``; Engram
        tables on the device) from CUDA graphs of the whole step, and the FFN sites of other steps of at most
        ``max_tokens`` tokens (``cuda_graphs``); results stay bitwise those of eager execution."""
        self.step_graphs = StepGraphs(max_tokens)
        return attach_sublayer_graphs(self, Block, max_tokens)

    def slot_specs(self, backtrack: int = 0) -> list[SlotSpec]:
        """The fixed-size buffers of one request (``slot_pool``), rings sized for a rollback of B tokens."""
        return v41_slot_specs(self.cfg, self.dtype, backtrack)

    def new_cache(
        self,
        new_rows: Callable[[object, int], RowStore] | None = None,
        backtrack: int = 0,
        slots: SlotState | None = None,
    ) -> V41SequenceCache:
        """An empty request cache; ``new_rows`` makes its growing stores (default: standalone tensors); ``slots``
        holds its fixed-size state (a request slot of the engine's pool made from ``slot_specs(backtrack)``;
        default: a private one-slot pool); ``backtrack`` B sizes the rings so that ``rollback_cache`` can undo up
        to B tokens."""
        if slots is None:
            slots = SlotPool.private(self.slot_specs(backtrack), self.embed.weight.device)
        cache = V41SequenceCache(slots, backtrack=backtrack)
        if new_rows is not None:
            cache.new_rows = new_rows
        return cache

    def restore_cache(
        self, snap: CacheSnapshot, new_rows: Callable[[object, int], RowStore], backtrack: int = 0
    ) -> V41SequenceCache:
        """A cache continuing from prefix snapshot ``snap`` (copied into a new request slot of its pool)."""
        return V41SequenceCache.restore(snap, new_rows, backtrack)

    def rollback_cache(self, cache: V41SequenceCache, num_tokens: int, token_ids: Callable[[int, int], list[int]]):
        """Undo the last ``num_tokens`` tokens of ``cache`` (rejected drafts; at most its backtrack B).
        ``token_ids(start, end)`` reads the request's kept tokens (the Engram lookback is rebuilt from them)."""
        new = cache.seq_len - num_tokens
        lookback = self.cfg.engram_max_ngram_size - 1
        ids = torch.tensor(token_ids(max(new - lookback, 0), new), dtype=torch.long, device=self.embed.weight.device)
        history = engram_next_history(self.engram_token_map[ids][None], None, self.cfg.engram_max_ngram_size)
        cache.rollback(num_tokens, history)

    def growing_ratios(self) -> set[int]:
        """Compression ratios of the growing cache kinds (an engine block must hold whole groups)."""
        return {self.cfg.compress_ratio(layer) for layer in self.cfg.kv_source_layer_ids}

    def prefix_replay_tokens(self) -> int:
        """Tokens a prefix hit must leave to recompute: the keep length K under YOCO truncation (decisions
        Y5: the decoder windows are rebuilt from the request's own last K tokens), else the last row."""
        return self.yoco_keep if self.yoco_mode != "off" else 1

    def cache_layout(self, backtrack: int = 0) -> CacheLayout:
        return v41_cache_layout(self.cfg, self.dtype, backtrack)

    # --- shared pieces -----------------------------------------------------------------------------------
    def engram_ids(self, ids: torch.Tensor, history: torch.Tensor | None) -> dict[int, torch.Tensor]:
        """Hash ids [S, 24] per Engram layer for one request's chunk ``ids`` [S]."""
        compressed = self.engram_token_map[ids][None]
        pad = self._engram_pad_id()
        out = {}
        for block in self.layers:
            if hasattr(block, "engram"):
                e = block.engram
                out[block.layer] = engram_hash_ids(compressed, history, e.multipliers, e.primes, pad)[0]
        return out

    def _engram_pad_id(self) -> int:
        """The compressed id of the Engram pad token (read from the device once per token map)."""
        token_map = self.engram_token_map
        if getattr(self, "_engram_pad", (None,))[0] != token_map._version:
            self._engram_pad = (token_map._version, int(token_map[self.cfg.engram_pad_token_id]))
        return self._engram_pad[1]

    def logits(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Final collapse with the last FFN pre, norm, fp32 head: [T, V]."""
        return linear(self.norm.collapse(x, pre_mix), self.head.weight, out_dtype=torch.float32)

    def dspark_feature(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """Stream means entering the tap layers [T, d] each -> main_norm(main_proj(concat)) [T, d]."""
        s0 = self.mtp[0]
        return s0.main_norm(s0.main_proj(torch.cat(taps, dim=-1)))

    # --- incremental forward -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, caches: list[V41SequenceCache], prompt_lens: list[int] | None = None
    ) -> torch.Tensor:
        """Run input_ids [B, S] as the next S tokens of B requests; logits [B, S, V] fp32 (see ``forward_step``)."""
        if input_ids.dim() != 2 or len(caches) != input_ids.shape[0]:
            raise ValueError(
                f"need input_ids [B, S] and one cache per request; got {tuple(input_ids.shape)}, {len(caches)} caches"
            )
        return torch.stack(self.forward_step(list(input_ids), caches, prompt_lens))

    @torch.no_grad()
    def forward_step(
        self,
        chunks: list[torch.Tensor],
        caches: list[V41SequenceCache],
        prompt_lens: list[int | None] | None = None,
        logit_rows: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """One engine step: request i runs its next ``chunks[i]`` tokens ([S_i] int64, S_i may differ and
        may be 0). Returns per request the fp32 logits [n_i, V] of ``logit_rows[i]`` (offsets into the chunk;
        None = every row). Caches advance by S_i.

        ``prompt_lens[i]`` (set for prefill chunks) turns on YOCO truncation as configured: decoder windows
        are floored at prompt_len - keep; in compact mode decoder rows before the floor are not computed
        and their logits are NaN.
        """
        cfg = self.cfg
        if len(caches) != len(chunks):
            raise ValueError(f"need one cache per request: {len(caches)} caches for {len(chunks)} chunks")
        dev = self.embed.weight.device
        batch = self.plan_decode(chunks, caches, prompt_lens)
        if batch is not None:
            logits = batch.run(torch.cat(chunks).to(dev), self._decode_rows)
            for c in caches:
                c.seq_len += 1
            return batch.per_request(logits, logit_rows)
        steps, start = [], 0
        for i, (ids, c) in enumerate(zip(chunks, caches)):
            floor = None
            if self.yoco_mode != "off" and prompt_lens is not None and prompt_lens[i] is not None:
                floor = max(prompt_lens[i] - self.yoco_keep, 0)
            n = ids.shape[0]
            positions = torch.arange(c.seq_len, c.seq_len + n, device=dev)
            steps.append(StepRows(slice(start, start + n), positions, c, floor, c.seq_len))
            start += n
        ids = torch.cat(chunks).to(dev)
        if (ids == cfg.image_token_id).any():  # one check per step (the engine refuses them at admission)
            raise ValueError(
                f"input contains image tokens (id {cfg.image_token_id}): this model has no vision tower loaded"
            )
        engram = [self.engram_ids(chunk.to(dev), st.cache.engram_history) for chunk, st in zip(chunks, steps)]
        x = embed_streams(self.embed.weight, ids, cfg.hc_mult)
        pre_mix = mhc_initial_pre_mix(x.shape[0], cfg.hc_mult, dev)
        shared = [dict() for _ in steps]
        taps: dict[int, torch.Tensor] = {}
        where = list(range(x.shape[0]))  # each flat row's index among the rows still computed (-1: dropped)
        comp_inputs, comp_rows = None, None
        all_steps = steps
        h = None  # this layer's attention input, when the layer before made it (``Block.run_chained``)
        for li, block in enumerate(self.layers):
            layer = block.layer
            if layer == cfg.n_prefill_layer and self.yoco_mode == "compact" and any(st.yoco_floor for st in steps):
                # the boundary layer's compressor reads every row; everything else runs on kept rows only
                comp_inputs, comp_rows = (block.attn_norm.collapse(x, pre_mix) if h is None else h), steps
                keep, steps, where = _kept_rows(steps, dev)
                x, pre_mix = x[keep], pre_mix[keep]
                h = None if h is None else h[keep]
            if hasattr(block, "engram"):
                e_ids = torch.cat([engram[i][layer] for i in range(len(steps))])
                x = block.engram(x, e_ids)
            if layer in cfg.dspark_target_layer_ids:
                taps[layer] = x.float().mean(dim=1).to(x.dtype)
            boundary = comp_inputs is not None and layer == cfg.n_prefill_layer
            comp = (comp_inputs, comp_rows) if boundary else None
            attn_fn = self._attention_step(block, steps, shared, comp)
            x, pre_mix, h = block.run_chained(x, pre_mix, attn_fn, h, self._next_attn_norm(li))
        # logits only for the rows asked for (a decode step needs one row per request, not S x 129280 floats)
        picked, sizes = [], []  # row ids built on the host: no device reads
        for i, st in enumerate(all_steps):
            n = st.rows.stop - st.rows.start
            want = range(n) if logit_rows is None or logit_rows[i] is None else logit_rows[i].tolist()
            picked += [where[st.rows.start + r] for r in want]
            sizes.append(len(want))
        ok = [k for k, w in enumerate(picked) if w >= 0]
        if len(ok) == len(picked):  # one head call for every request's rows
            idx = long_tensor(picked, dev)
            flat = self.logits(x[idx], pre_mix[idx])
        else:
            flat = torch.full((len(picked), cfg.vocab_size), float("nan"), device=dev)
            if ok:
                idx = long_tensor([picked[k] for k in ok], dev)
                flat[long_tensor(ok, dev)] = self.logits(x[idx], pre_mix[idx])
        outs = list(flat.split(sizes))
        if self.mtp and taps:
            feats = self.dspark_feature([taps[t] for t in cfg.dspark_target_layer_ids])
            for st in steps:
                self._write_dspark_context(feats[st.rows], st.positions, st.cache, st.start)
        for chunk, st in zip(chunks, all_steps):
            c = st.cache
            c.engram_history = engram_next_history(
                self.engram_token_map[chunk.to(dev)][None], c.engram_history, cfg.engram_max_ngram_size
            )
            c.seq_len += chunk.shape[0]
        return outs

    def _next_attn_norm(self, i: int) -> Norm | None:
        """Layer i + 1's attention norm, for layer i to make that layer's input (``Block.run_chained``); None after
        the last layer and before an Engram layer (its gate changes the streams first)."""
        if i + 1 >= len(self.layers) or hasattr(self.layers[i + 1], "engram"):
            return None
        return self.layers[i + 1].attn_norm

    def plan_decode(
        self, chunks: list[torch.Tensor], caches: list[V41SequenceCache], prompt_lens: list[int | None] | None
    ) -> DecodeBatch | None:
        """The plan of a decode step run as one batch (``decode_batch``), or None where the general path runs: a
        chunk of other than one token, a prompt length (a YOCO floor), a request without its Engram lookback yet,
        requests outside one slot pool or one engine's paged pools. Image tokens are not checked here (the engine
        refuses them at admission; the check would read the device)."""
        floors = self.yoco_mode != "off" and prompt_lens is not None and any(n is not None for n in prompt_lens)
        if not caches or floors or any(ch.shape[0] != 1 for ch in chunks):
            return None
        pool, cfg = caches[0].slots.pool, self.cfg
        if any(c.slots.pool is not pool for c in caches) or (
            cfg.engram_layer_ids and not all(c.has_history for c in caches)
        ):
            return None
        ratios = {src: cfg.compress_ratio(src) for src in cfg.kv_source_layer_ids}
        sources = {src: [c.source(src, r) for c in caches] for src, r in ratios.items()}
        kv_pools = paged_stores([s for group in sources.values() for src in group for s in (src.entries, src.keys)])
        if ratios and kv_pools is None:
            return None
        dev = self.embed.weight.device
        # an Engram table the device cannot read in place (pageable host memory) is read through the host: no graphs
        in_place = all(b.engram.in_place(dev) for b in self.layers if hasattr(b, "engram"))
        graphs = self.step_graphs if in_place else None
        batch = DecodeBatch([c.seq_len for c in caches], [c.slots.slot for c in caches], pool, graphs)
        windows = [("window", i) for i in range(cfg.num_hidden_layers)]
        batch.plan_ring(windows, cfg.sliding_window - 1)  # compact YOCO layers whose windows differ: on their own
        rings: dict[int, list] = {}  # compressors of one ratio move together
        for src, r in ratios.items():
            if r > 1:
                rings.setdefault(r, []).extend([("kv", src), ("score", src)])
        for r, keys in rings.items():
            batch.plan_ring(keys, r - 1)
        appends: dict[int, tuple[dict, dict]] = {}  # ratio -> (stores, entry widths) by source and kind
        for src, r in ratios.items():
            stores, widths = appends.setdefault(r, ({}, {}))
            stores[("kv", src)], widths[("kv", src)] = [s.entries for s in sources[src]], cfg.head_dim
            stores[("idx", src)], widths[("idx", src)] = [s.keys for s in sources[src]], cfg.index_head_dim
        for r, (stores, widths) in appends.items():
            batch.plan_append(stores, r, widths, self.dtype)
        for k in range(len(self.mtp)):
            batch.plan_ring([("dspark", k)], 0)
        if self.mtp:  # the step writes each request's context key at its position (``_decode_rows``)
            for c in caches:
                c.ctx_end = c.seq_len + 1
        batch.plan_positions(ratios.values())
        if ratios:
            first = next(iter(sources.values()))
            batch.plan_tables([s.entries.table for s in first], kv_pools.block_size, bucket=batch.graphs is not None)
        if cfg.engram_layer_ids:
            self._engram_pad_id()  # read once, outside any graph capture
        return batch.seal(dev)

    def _decode_rows(self, batch: DecodeBatch, ids: torch.Tensor) -> torch.Tensor:
        """The device work of a planned decode step (static shapes, no host reads): ids [rows] -> logits [rows, V];
        replayed from a CUDA graph where ``enable_cuda_graphs`` was called (``DecodeBatch.run``). The Engram
        lookback of each request is read from and written back to its slot; the DSpark context keys go to their
        rings."""
        cfg, rows, slots = self.cfg, batch.rows, batch["slots"]
        x = embed_streams(self.embed.weight, ids, cfg.hc_mult)
        pre_mix = mhc_initial_pre_mix(rows, cfg.hc_mult, ids.device)
        compressed = self.engram_token_map[ids][:, None]
        history = batch.buffers[("engram",)][slots].view(rows, -1) if cfg.engram_layer_ids else None
        shared, taps, values = {}, {}, {}

        def engram_values(e: Engram) -> tuple[torch.Tensor, torch.Tensor]:  # (values, the gate's weight)
            e_ids = engram_hash_ids(compressed, history, e.multipliers, e.primes, self._engram_pad_id())
            return e.values(e_ids[:, 0], x.dtype, x.device), e.gate_weight()

        def write_lookback() -> None:  # each slot's next lookback (``history`` is a copy of the old one)
            nxt = engram_next_history(compressed, history, cfg.engram_max_ngram_size)
            batch.buffers[("engram",)][slots] = nxt.view(rows, -1, 1)

        # token ids only: made from the step's start beside the layers before each Engram gate, where the table is
        # local (a rank-sharded table's lookup is a collective: it keeps its place in the forward order)
        local = [b.engram for b in self.layers if hasattr(b, "engram") and b.engram.row_range is None]
        lane = SideStream.of(ids.device, "engram")
        if local:
            with lane.branch():
                values = {e: engram_values(e) for e in local}
                if history is not None:  # here too, off the step's end (after the LM head: ~6 us at batch 1)
                    write_lookback()
        h = None  # this layer's attention input, when the layer before made it (``Block.run_chained``)
        for i, block in enumerate(self.layers):
            if hasattr(block, "engram"):
                lane.join()
                e = block.engram
                x = e.inject(x, *(values[e] if e in values else engram_values(e)))
            if block.layer in cfg.dspark_target_layer_ids:
                taps[block.layer] = x.float().mean(dim=1).to(x.dtype)
            attn_fn = partial(block.attn.forward_decode, batch=batch, shared=shared)
            x, pre_mix, h = block.run_chained(x, pre_mix, attn_fn, h, self._next_attn_norm(i))
        if CANDIDATE_LANE:  # the candidate lane rejoins the main path before the step ends (a graph capture's rule)
            SideStream.of(x.device, "candidates").join()
            shared.pop("candidate_inputs", None)
        logits = self.logits(x, pre_mix)
        if self.mtp and taps:
            feats = self.dspark_feature([taps[t] for t in cfg.dspark_target_layer_ids])
            for k, stage in enumerate(self.mtp):
                batch.write(("dspark", k), stage.attn.window_kv(feats, batch["pos"]))
        if history is not None and not local:  # a rank-sharded table's step: no lane
            write_lookback()
        return logits

    def _attention_step(self, block: Block, steps: list[StepRows], shared: list[dict], comp):
        """The attention sublayer over a token-flat step: each request's rows against its own cache.
        ``comp`` = (inputs, rows) of the boundary compressor in compact YOCO mode, else None."""
        decoder = block.layer >= self.cfg.n_prefill_layer

        def attn_fn(u: torch.Tensor) -> torch.Tensor:
            outs = []
            for j, st in enumerate(steps):
                xc, pc = (
                    (u[st.rows], st.positions) if comp is None else (comp[0][comp[1][j].rows], comp[1][j].positions)
                )
                floor = st.yoco_floor if decoder else None
                outs.append(
                    block.attn.forward_chunk(u[st.rows], xc, st.positions, pc, st.cache, floor, shared[j], st.start)
                )
            return torch.cat(outs)

        return attn_fn

    def _write_dspark_context(self, feat: torch.Tensor, pos: torch.Tensor, cache: V41SequenceCache, start: int) -> None:
        """Each stage's context key for target rows ``pos`` (= start, start + 1, ...; spec procedure D step 1)."""
        if not pos.numel():
            return
        for k, stage in enumerate(self.mtp):
            cache.dspark_ctx[k].write(start, stage.attn.window_kv(feat, pos))
        cache.ctx_end = start + pos.numel()

    @property
    def dspark_block_size(self) -> int:
        return self.cfg.dspark_block_size

    def dspark_markov(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(W1 [V, R], W2 [V, R], confidence weight [1, d + R]) of the last stage (checkpoint ``embed`` / ``head``)."""
        last = self.mtp[-1]
        return last.markov_head.embed.weight, last.markov_head.head.weight, last.confidence_head.proj.weight

    @torch.no_grad()
    def dspark_hidden(self, anchors: torch.Tensor, caches: list[V41SequenceCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """Procedure D steps 1-4 for each request's block: rows [anchor, noise x (N-1)] at positions
        a .. a+N-1 (a = the cache's seq_len) attend to each stage's last W context rows and to each other.

        Returns (base logits U fp32 [B, N, V] = head(norm(h)), pre-norm hiddens h [B, N, d]); the Markov
        stage (``deepinfer_spec.markov_drafts``) turns them into drafts.
        """
        cfg = self.cfg
        if not self.mtp:
            raise ValueError("this checkpoint has no DSpark head (num_nextn_predict_layers = 0)")
        n = cfg.dspark_block_size
        bases, hiddens = [], []
        for anchor, cache in zip(anchors.tolist(), caches):
            pos, ids, x = draft_block_inputs(
                anchor, cache, n, cfg.dspark_noise_token_id, self.embed.weight, cfg.hc_mult
            )
            pre_mix = mhc_initial_pre_mix(n, cfg.hc_mult, x.device)
            for k, stage in enumerate(self.mtp):
                ring = cache.dspark_ctx[k]
                ctx = ring.read(max(ring.lo, ring.end - stage.attn.window), ring.end)
                x, pre_mix = stage.run(x, pre_mix, partial(stage.block_attention, pos=pos, ctx=ctx))
            h = mhc_collapse(x, pre_mix)
            bases.append(linear(self.mtp[-1].norm(h), self.head.weight, out_dtype=torch.float32))
            hiddens.append(h)
        return torch.stack(bases), torch.stack(hiddens)

    @torch.no_grad()
    def draft_block(
        self,
        anchors: torch.Tensor,
        caches: list[V41SequenceCache],
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        confidence_temperature: float = 1.0,
    ) -> DraftBlock:
        """Draft N = dspark_block_size tokens after each request's anchor (the token at position seq_len),
        sampled one by one with the Markov bias (greedy when ``temperature`` is 0; ``generator`` otherwise).
        Returns tokens, confidences c_k = sigmoid(clamp(w.[h_k; W1[x_{k-1}]] / T, +-60)) and the processed
        draft log-distributions. (The engine's proposer samples with each request's own parameters and
        seeded streams instead: ``deepinfer_runtime.engine.proposers``.)
        """
        base, hidden = self.dspark_hidden(anchors, caches)
        last = self.mtp[-1]
        w1 = last.markov_head.embed.weight
        out_tok, out_conf, out_lp = [], [], []
        for anchor, u, h in zip(anchors.tolist(), base, hidden):
            prev, toks, confs, lps = anchor, [], [], []
            for k in range(u.shape[0]):
                m = w1[prev].float()
                logits_k = u[k] + linear(m[None], last.markov_head.head.weight.float())[0]
                feat = torch.cat([h[k].float(), m])
                c = linear(feat[None], last.confidence_head.proj.weight.float())[0, 0] / confidence_temperature
                confs.append(torch.sigmoid(c.clamp(-60, 60)))
                lp = torch.log_softmax(logits_k / max(temperature, 1e-5), dim=-1)
                if temperature == 0:
                    prev = int(lp.argmax())
                else:
                    prev = int(torch.multinomial(lp.exp(), 1, generator=generator))
                toks.append(prev)
                lps.append(lp)
            out_tok.append(toks)
            out_conf.append(torch.stack(confs))
            out_lp.append(torch.stack(lps))
        return DraftBlock(torch.tensor(out_tok, device=anchors.device), torch.stack(out_conf), torch.stack(out_lp))

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full forward of input_ids [B, S] from position 0 (no truncation): float logits [B, S, V]."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor [batch, seq]; got {input_ids.dtype}{tuple(input_ids.shape)}"
            )
        bad = (input_ids < 0) | (input_ids >= self.cfg.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(input_ids[bad][0])} outside the vocabulary [0, {self.cfg.vocab_size})")
        mode, self.yoco_mode = self.yoco_mode, "off"
        try:
            return self.forward(input_ids.long(), [self.new_cache() for _ in range(input_ids.shape[0])])
        finally:
            self.yoco_mode = mode


__all__ = ["DeepseekV41ForCausalLM", "V41SequenceCache", "DraftBlock", "TRUNCATION_MODES"]


def v41_cache_layout(cfg: DeepseekV41Config, dtype: torch.dtype, backtrack: int = 0) -> CacheLayout:
    """Bytes of the reference model's per-request state, by cache kind (latents kept in ``dtype``; the packed GPU
    records are ``deepseek_v41_cache_bytes.cache_bytes_per_token``): what one slot of the ``slot_pool`` holds.
    ``backtrack`` B: the rings' extra rows for speculative rollback (windows W + B, DSpark context W + B,
    compressor projections ratio + B)."""
    e = torch.finfo(dtype).bits // 8
    w, d, dh, b = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, backtrack
    sources = [(layer, cfg.compress_ratio(layer)) for layer in cfg.kv_source_layer_ids]
    return CacheLayout(
        (
            CacheKind("window latents", 0, cfg.num_hidden_layers * (w + b) * d * e),
            CacheKind("compressed KV", sum(d * e / r for _, r in sources), 0),
            CacheKind("index keys", sum(dh * e / r for _, r in sources), 0),
            CacheKind("compressor tails (fp32)", 0, sum((r + b) * 2 * d * 4 for _, r in sources if r > 1)),
            CacheKind("Engram lookback", 0, (cfg.engram_max_ngram_size - 1) * 8 if cfg.engram_layer_ids else 0),
            CacheKind("DSpark context", 0, cfg.num_nextn_predict_layers * (w + b) * d * e),
        )
    )

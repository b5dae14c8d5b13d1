"""DeepSeek-V4-Flash (``DeepseekV4ForCausalLM``) assembled from the deepinfer-kernels ops.

Reading order: attention pieces (compressor, indexer, attention) -> MoE -> block -> model.
Parameter names equal the released checkpoint's tensor names (``layers.3.attn.wq_a.weight``),
except that routed experts are stacked per layer (``layers.3.ffn.experts.w13`` [E, 2I, d] and
``.w2`` [E, d, I]); ``deepseek_v4_weights.py`` maps one onto the other.

Numerics follow transformers 5.23.0 (the oracle; see architecture.md section 6) where it is
explicit, and the DeepSeek reference elsewhere: norms, RoPE, mHC, router, SwiGLU, compressor
pooling and attention softmax in fp32; the LM head in fp32. No QAT fake-quantisation of the KV
(transformers has none; the V4 reference's KV FP8 simulation is a later option).

Layout: activations are token-flat ([T, d] with T = batch x new tokens); attention and the
compressors run per request on that request's ``SequenceCache``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from deepinfer_kernels import (
    grouped_linear,
    indexer_scores,
    indexer_scores_paged,
    indexer_topk,
    kv_compress_pool,
    kv_compress_pool_rows,
    linear,
    mhc_collapse,
    mhc_head_weights,
    mhc_pre_collapse_rms_norm,
    mhc_same_site_sublayer,
    moe_route_hash,
    moe_route_topk,
    overlap_windows,
    rms_norm_rope,
    rope_interleaved,
    rope_inv_freq,
    sparse_mqa_attention,
    without_early_launch,
)
from deepinfer_kernels.registry import batch_invariant
from torch import nn

from deepinfer_runtime.cache_layout import CacheKind, CacheLayout
from deepinfer_runtime.cuda_graphs import StepGraphs, SublayerGraphs, attach_sublayer_graphs
from deepinfer_runtime.decode_batch import DecodeBatch, paged_stores
from deepinfer_runtime.host_copy import long_tensor
from deepinfer_runtime.models.deepseek_v4_cache import (
    CompressorState,
    LayerCache,
    RowFactory,
    SequenceCache,
    v4_compressors,
    v4_slot_specs,
)
from deepinfer_runtime.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_runtime.models.deepseek_v4_mtp import MTPState, head_logits
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
from deepinfer_runtime.slot_pool import CacheSnapshot, SlotPool, SlotSpec, SlotState


class Compressor(nn.Module):
    """Gated softmax pooling of every ``ratio`` tokens into one entry (CSA: overlapping windows).

    ``head_dim`` is the entry width; ``overlap`` doubles the projection (A/B halves, section A.5).
    """

    def __init__(self, cfg: DeepseekV4Config, ratio: int, head_dim: int, overlap: bool, dtype: torch.dtype):
        super().__init__()
        width = head_dim * (2 if overlap else 1)
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.wkv = Linear(cfg.hidden_size, width, dtype)
        self.wgate = Linear(cfg.hidden_size, width, dtype)
        self.ape = param(ratio, width, dtype=torch.float32)
        self.norm = Norm(head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, state: CompressorState, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """Feed x [S, d] at ``positions`` [S]; return all entries so far [N, head_dim]."""
        # NOTE: projections in fp32 as the DeepSeek reference does (transformers runs them in the
        # model dtype; identical in fp32, and fp32 is what the model was trained with).
        kv = linear(x, self.wkv.weight, out_dtype=torch.float32)
        score = linear(x, self.wgate.weight, out_dtype=torch.float32) + self.ape[positions % self.ratio]
        pending_kv, pending_score, prev_kv, prev_score = state.carried()  # read before the rings take the rows
        state.write(kv, score)
        kv, score = torch.cat([pending_kv, kv]), torch.cat([pending_score, score])
        usable = kv.shape[0] // self.ratio * self.ratio
        if usable:
            first = state.num_entries
            n_new = usable // self.ratio
            kv = kv[:usable].view(n_new, self.ratio, -1)
            score = score[:usable].view(n_new, self.ratio, -1)
            if self.overlap:
                grouped_kv, grouped_score = overlap_windows(kv, score, prev_kv, prev_score)
            else:
                grouped_kv, grouped_score = kv, score
            pooled = kv_compress_pool(grouped_kv, grouped_score).to(x.dtype)
            entry_pos = (torch.arange(n_new, device=x.device) + first) * self.ratio
            state.store().append(self.norm.rope(pooled, entry_pos, inv_freq))
        entries = state.store().view()
        return entries if entries is not None else x.new_zeros(0, self.head_dim)

    def group_rows(self, batch: DecodeBatch, key: tuple) -> torch.Tensor:
        """[rows, r] (overlap: [rows, 2r]) the ring rows of the group each request's step completes, oldest first,
        -1 where it completes none (or, with overlap, where the previous window's A-halves are not held): from the
        plan alone, so a step makes them before its projections (``decode``'s ``rows``)."""
        r = self.ratio
        return batch.ring_ids((*key, "kv"), 2 * r if self.overlap else r, every=r)

    def decode(
        self, kv, score, batch: DecodeBatch, key: tuple, inv_freq: torch.Tensor, dtype: torch.dtype, rows
    ) -> None:
        """``forward`` for a planned decode step (``decode_batch``), from the step's projections kv = x wkv^T and
        score = x wgate^T ([rows, width] fp32, one row per request; ``Attention.decode`` makes them with the
        layer's other projections of x); entries in ``dtype``; ``key`` = (name, layer) of its rings and store;
        ``rows``: ``group_rows`` (the caller makes them early, from the plan alone).
        The requests whose row completes a group pool it from their rings in place (the others' rows are empty:
        their NaN entries go to the scratch row the plan gave them)."""
        r, c = self.ratio, self.head_dim
        kv_table = batch.write((*key, "kv"), kv)
        # the ring holds score + ape[p % r], summed in the write's kernel
        score_table = batch.write((*key, "score"), score, bias=(self.ape, batch[("pos_mod", r)]))
        pooled = kv_compress_pool_rows(kv_table, score_table, rows, r if self.overlap else 0, c, out_dtype=dtype)
        pool, emit = batch.append_rows(key)  # the norm + RoPE kernel stores the entries itself
        self.norm.rope(pooled, batch[("group_start", r)], inv_freq, out=pool, out_rows=emit)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: picks up to ``index_topk`` compressed entries per query."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = cfg.compress_rates[CSA]
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, dtype)
        self.compressor = Compressor(cfg, self.ratio, self.head_dim, overlap=True, dtype=dtype)

    def query(
        self, x: torch.Tensor | None, qr: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, xw=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, d], qr [S, q_lora_rank] -> (post-RoPE queries [S, H, Dh], head weights [S, H] fp32 with the
        1/sqrt(H) scale). ``xw``: x weights_proj^T when the caller made it already (x is then not read)."""
        xw = self.weights_proj(x) if xw is None else xw
        return self.rotated_query(qr, positions, inv_freq), self.head_weights(xw)

    def rotated_query(self, qr: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        return rope_interleaved(q, positions, inv_freq, out=q)  # in place: only the rotated channels move

    def head_weights(self, xw: torch.Tensor) -> torch.Tensor:
        return xw.float() * self.n_heads**-0.5

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        state: CompressorState,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """x [S, d], qr [S, q_lora_rank] -> selected entry ids [S, k] (-1 = none)."""
        keys = self.compressor(x, positions, state, inv_freq)
        q, weights = self.query(x, qr, positions, inv_freq)
        visible = ((positions + 1) // self.ratio)[None]
        # with visible, the keys past a query's last complete window are -inf, not computed (causal: half of them)
        scores = indexer_scores(q[None], keys[None], weights[None], self.head_dim**-0.5, visible)
        return indexer_topk(scores, visible, self.topk)[0]

    def decode_keys(self, proj: list[torch.Tensor], batch: DecodeBatch, layer: int, inv_freq, dtype, rows):
        """What a planned decode step makes beside its query (the caller's branch): the head weights [rows, H] fp32
        from proj[0] and the index keys' compressor step from proj[1:3] (``projections``; keys in ``dtype``;
        ``rows``: the compressor's ``group_rows``). Returns the head weights (read after the join)."""
        weights = self.head_weights(proj[0])
        self.compressor.decode(proj[1], proj[2], batch, ("idx", layer), inv_freq, dtype, rows)
        return weights

    def decode(
        self,
        weights: torch.Tensor,
        q: torch.Tensor,
        batch: DecodeBatch,
        layer: int,
        row_map: tuple | None = None,
        after: SideStream | None = None,
    ) -> torch.Tensor:
        """``forward`` for a planned decode step from the rotated queries q [rows, H, Dh] (``rotated_query``) and the
        head weights [rows, H] that ``decode_keys`` made with the index keys (on the caller's lane, ordered after
        them) -> entry ids [rows, k]. With ``row_map`` (``DecodeBatch.pool_row_map``) the attention's row table of
        the picks instead, [rows, P + k] int64 (``indexer_topk``'s), its top-k started after the work so far of lane
        ``after`` (a ``SideStream``; the one that made the map's prefix), which the scores do not wait for."""
        pool, tables = batch.pages(("idx", layer))  # every request's index keys, read in place
        scores = indexer_scores_paged(q[:, None], pool, tables, weights[:, None], self.head_dim**-0.5)
        visible = batch[("visible", self.ratio)][:, None]  # a request's rows past its own entries are never visible
        if after is not None:
            after.depend()
        return indexer_topk(scores, visible, self.topk, row_map=row_map)[:, 0]

    def projections(self) -> tuple[list[Linear], list[torch.dtype | None]]:
        """The indexer's projections of the layer's normed input x, in ``decode``'s ``proj`` order."""
        c, f32 = self.compressor, torch.float32
        return [self.weights_proj, c.wkv, c.wgate], [None, f32, f32]


# CSA decode: the q up-projection (a 67 MB weight stream) launched without programmatic dependent launch, so that
# the index scores forked beside it get SMs first instead of waiting for the whole stream (``without_early_launch``).
# The same bits. H200, pipelined ms, two alternating rounds in one lease (``benchmarks/ab_slice.py``, session 25):
# batch 1 1.108 -> 1.107 (4K), 1.130 -> 1.129 (32K); batch 8 at 32K 2.252 -> 2.240.
INDEX_LANE_FIRST = True

# CSA decode: the index lane's top-k writes the attention's row table [window rows | pool rows of the picks] itself
# (``indexer_topk``'s ``row_map``), in place of the ``paged_rows`` launch after it (``DecodeBatch.pool_rows``: ~4.4
# us on the index lane, the attention's critical path, per CSA layer at batch 1 on an H200); the window lane is then
# awaited before the top-k (the prefix is its row ids), not after it. The same bits. H200, pipelined ms, two
# alternating rounds in one lease (``benchmarks/ab_slice.py``, session 26): 4K batch 1 / 8 1.096 / 2.148 -> 1.090 /
# 2.145, 32K 1.113 / 2.203 -> 1.108 / 2.190.
FUSED_POOL_ROWS = True


class Attention(nn.Module):
    """Shared-KV MQA over a sliding window plus compressed entries, with sinks (section A.4)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, dtype: torch.dtype, kind: str | None = None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.kind = kind or cfg.layer_types[layer]
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = Norm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = Norm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = param(self.n_heads, dtype=torch.float32)
        if self.kind != SLIDING:
            ratio = cfg.compress_rates[self.kind]
            self.compressor = Compressor(cfg, ratio, self.head_dim, overlap=self.kind == CSA, dtype=dtype)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, dtype)
        base = cfg.rope_theta if self.kind == SLIDING else cfg.compress_rope_theta
        yarn = None if self.kind == SLIDING else cfg.yarn
        self.register_buffer("inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, base, yarn), persistent=False)

    def query(self, x: torch.Tensor, pos: torch.Tensor, xa=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] (normed) at ``pos`` [T] -> (q_lora rows qr [T, q_lora_rank], post-RoPE queries [T, H, D]).
        ``xa``: x wq_a^T when the caller made it already."""
        qr = self.q_norm(self.wq_a(x) if xa is None else xa)
        return qr, self.query_up(qr, pos)

    def query_up(self, qr: torch.Tensor, pos: torch.Tensor, early: bool = True) -> torch.Tensor:
        """qr [T, q_lora_rank] -> post-RoPE queries [T, H, D]. ``early`` False: the up-projection is launched without
        programmatic dependent launch (``without_early_launch``), for the index lane beside it to find SMs."""
        with without_early_launch(not early):
            q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        return rms_norm_rope(q, None, self.cfg.rms_norm_eps, pos, self.inv_freq)  # per-head norm, then RoPE

    def window_kv(self, x: torch.Tensor, pos: torch.Tensor, xkv=None) -> torch.Tensor:
        """x [T, d] at ``pos`` -> the shared post-RoPE key/value latents [T, D] (``xkv``: x wkv^T, made already)."""
        return self.kv_norm.rope(self.wkv(x) if xkv is None else xkv, pos, self.inv_freq)

    def output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Attention outputs o [T, H, D] at ``pos`` -> [T, d]: inverse RoPE, grouped wo_a, wo_b."""
        o = rope_interleaved(o, pos, self.inv_freq, inverse=True, out=o)  # o is the attention's fresh output
        return self.project_out(o)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention outputs o [T, H, D], already rotated back -> [T, d]: grouped wo_a, wo_b."""
        o = grouped_linear(o.reshape(o.shape[0], self.cfg.o_groups, -1), self.wo_a.weight)
        return self.wo_b(o.flatten(1))

    def forward(
        self, x: torch.Tensor, positions: list[torch.Tensor], caches: list[LayerCache], starts: list[int] | None = None
    ) -> torch.Tensor:
        """x [T, d] (normed), positions: per request [S_b] (sum S_b = T) -> [T, d]. ``starts``: each request's
        first position as a host int (read from the device when absent: a sync)."""
        pos = torch.cat(positions)
        qr, q = self.query(x, pos)
        kv = self.window_kv(x, pos)
        starts = starts if starts is not None else [int(p[0]) if p.numel() else 0 for p in positions]
        outs, row = [], 0
        for p, first, cache in zip(positions, starts, caches):
            rows = slice(row, row + p.shape[0])
            row += p.shape[0]
            outs.append(self._attend_one(x[rows], qr[rows], q[rows], kv[rows], p, first, cache))
        # one request: its [T, H, D] output as it is (a cat of one tensor copies it: 0.5 GB for 8K tokens)
        return self.output(outs[0] if len(outs) == 1 else torch.cat(outs), pos)

    def _attend_one(self, x, qr, q, kv, positions, start: int, cache: LayerCache) -> torch.Tensor:
        win = self.cfg.sliding_window
        rows, base = cache.append_window(kv, win, start)  # latents of positions base .. last
        # window: positions t-win+1 .. t, as rows of `rows`
        key_pos = positions[:, None] - win + 1 + torch.arange(win, device=x.device)
        idx = torch.where(key_pos >= 0, key_pos - base, -1)
        kv_all = rows
        if self.kind != SLIDING:
            entries = self.compressor(x, positions, cache.compressor, self.inv_freq)
            if self.kind == CSA:
                picked = self.indexer(x, qr, positions, cache.indexer, self.inv_freq)
            else:  # HCA: every complete window is visible
                ids = torch.arange(entries.shape[0], device=x.device)
                visible = (positions + 1) // self.compressor.ratio
                picked = torch.where(ids[None] < visible[:, None], ids[None], -1)
            idx = torch.cat([idx, torch.where(picked >= 0, picked + rows.shape[0], -1)], dim=1)
            kv_all = (rows, entries.to(rows.dtype))  # two segments: [window rows | entries]
        return sparse_mqa_attention(q, kv_all, idx, self.attn_sink, self.head_dim**-0.5)

    def projections(self) -> tuple[list[Linear], list[torch.dtype | None]]:
        """Every projection of the normed input x a decode step makes, with its out dtype: wq_a, wkv, then the
        compressor's wkv / wgate (fp32), then the indexer's (``Indexer.projections``). ``decode`` makes them in one
        ``project`` call (one launch at decode sizes)."""
        lins, dts = [self.wq_a, self.wkv], [None, None]
        if self.kind != SLIDING:
            lins += [self.compressor.wkv, self.compressor.wgate]
            dts += [torch.float32, torch.float32]
        if self.kind == CSA:
            more, more_dts = self.indexer.projections()
            lins, dts = lins + more, dts + more_dts
        return lins, dts

    def decode(self, x: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """``forward`` for a planned decode step (``decode_batch``): x [rows, d] (normed), one row per request ->
        [rows, d]. One attention call over two segments: the window rows of every request [rows x W, D] and the
        pool of compressed entries, read in place through each request's block table."""
        pos, key, dev = batch["pos"], ("comp", self.layer), x.device
        # Beside the query path, what nothing on it reads before the join, on lanes of their own: the compressor
        # (ring writes, pooling, entry stores), the window's latents (norm + RoPE into the ring) and, on CSA, the
        # index keys' compressor, so that the index scores wait for their keys alone. Each lane first makes what
        # it reads from the plan alone, beside the projections (the window's and the groups' ring rows; HCA's
        # whole attention row table), and after them only the latents' few kernels: while the q up-projection
        # streams its weight a side kernel takes 3-5 us, not 1-2, and the chain used to end after the query.
        comp, window = SideStream.of(dev), SideStream.of(dev, "window")
        index = SideStream.of(dev, "index") if self.kind == CSA else None
        with window.branch():
            table, win_ids = batch.window_rows(("window", self.layer))
            if self.kind == HCA:  # every entry a request sees (its first `visible`), after its window rows
                visible = batch[("visible", self.compressor.ratio)]
                idx = batch.pool_rows(
                    key, batch.entry_capacity(key), limit=visible, offset=table.shape[0], prefix=win_ids
                )
        if self.kind != SLIDING:
            with comp.branch():
                groups = self.compressor.group_rows(batch, key)
        if index is not None:
            with index.branch():
                index_groups = self.indexer.compressor.group_rows(batch, ("idx", self.layer))
        proj = project(x, *self.projections())
        if self.kind != SLIDING:
            with comp.branch():
                self.compressor.decode(proj[2], proj[3], batch, key, self.inv_freq, x.dtype, groups)
        with window.branch():  # the new latents straight into their ring rows (the window's newest column)
            self.kv_norm.rope(proj[1], pos, self.inv_freq, out=table, out_rows=win_ids[:, -1])
        if index is not None:
            with index.branch():
                weights = self.indexer.decode_keys(proj[4:], batch, self.layer, self.inv_freq, x.dtype, index_groups)
        qr = self.q_norm(proj[0])
        if index is not None:
            # CSA: the index query streams its (smaller) weight first; the scores, the top-k and the row table
            # [window rows | pool rows of the picked entries] then run on the index lane beside the q
            # up-projection, which used to run first, so that the top-k (6-40 us) started after both streams
            qi = self.indexer.rotated_query(qr, pos, self.inv_freq)
            with index.branch():
                if FUSED_POOL_ROWS:  # the top-k makes the row table (reading the window's row ids)
                    row_map = batch.pool_row_map(key, table.shape[0], win_ids)
                    idx = self.indexer.decode(weights, qi, batch, self.layer, row_map, after=window)
                else:
                    picked = self.indexer.decode(weights, qi, batch, self.layer)
                    window.depend()  # its row ids
                    idx = batch.pool_rows(key, picked, offset=table.shape[0], prefix=win_ids)
        q = self.query_up(qr, pos, early=index is None or not INDEX_LANE_FIRST)
        comp.join()
        window.join()
        if index is not None:
            index.join()
        if self.kind == SLIDING:
            kv_all, idx = table, win_ids
        else:
            kv_all = (table, batch.kv[key].flat)  # the entries are read in place, from the pool
        o = attention_rotated_back(q, kv_all, idx, self.attn_sink, self.head_dim**-0.5, pos, self.inv_freq)
        return self.project_out(o)


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.is_hash = cfg, cfg.is_hash_layer(layer)
        self.weight = param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
            self._checked_table: tuple | None = None  # (object, storage, version) of the table last range-checked
        else:
            self.bias = param(cfg.n_routed_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.weight, out_dtype=torch.float32)
        kw = dict(
            route_scale=self.cfg.routed_scaling_factor, scoring=self.cfg.scoring_func, norm_topk=self.cfg.norm_topk_prob
        )
        if self.is_hash:
            # the range checks read the device (a sync mid-forward on a GPU): once per table (a loaded or replaced
            # table is checked on its first use); token ids are checked at admission, and the embedding reads them first
            table = (id(self.tid2eid), self.tid2eid.data_ptr(), self.tid2eid._version)
            check = not logits.is_cuda or table != self._checked_table
            out = moe_route_hash(logits, self.tid2eid, input_ids, check_ranges=check, **kw)
            self._checked_table = table
            return out
        return moe_route_topk(logits, self.bias, self.cfg.num_experts_per_tok, **kw)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, layer, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, dtype)
        self.shared_experts = SharedExpert(cfg.moe_intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, split: bool = False):
        """x [T, d] -> [T, d]; ``split``: (routed, shared), whose sum that is (``routed_plus_shared``)."""
        return routed_plus_shared(
            x, lambda: self.gate(x, input_ids), self.experts, self.shared_experts, self.limit, split
        )  # fmt: skip


SPLIT_SITE_MAX_TOKENS = 64  # V4 sites of at most this many tokens split pre from post / comb (``Block.site``)


class Block(MhcBlock):
    """Layer ``layer`` (its attention kind from the schedule unless ``kind`` is given: the MTP layer's). With
    ``graphs`` (``cuda_graphs.SublayerGraphs``, set by ``enable_cuda_graphs``) the FFN sublayer of short steps
    replays a CUDA graph."""

    graphs = None

    def __init__(self, cfg: DeepseekV4Config, layer: int, dtype: torch.dtype, kind: str | None = None):
        super().__init__(cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        d = cfg.hidden_size
        self.attn_norm = Norm(d, cfg.rms_norm_eps)
        self.ffn_norm = Norm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, dtype, kind)
        self.ffn = MoE(cfg, layer, dtype)

    def forward(self, x, input_ids, positions, caches, starts=None):
        """x [T, n, d] streams -> [T, n, d] (V4 wiring: each site collapses with its own pre)."""
        return self.run_block(x, input_ids, lambda u: self.attn(u, positions, caches, starts))

    def decode(self, x: torch.Tensor, input_ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """``forward`` for a planned decode step (``decode_batch``): streams x [rows, n, d] -> [rows, n, d]."""
        return self.run_block(x, input_ids, lambda u: self.attn.decode(u, batch))

    def run_block(self, x, input_ids, attn_fn):
        """x [T, n, d] -> [T, n, d] with the attention sublayer ``attn_fn(normed input [T, d]) -> [T, d]``."""
        x = self.site(x, attn_fn, "attn", self.attn_norm)
        if self.graphs is not None and self.graphs.applies(x):
            return self.graphs.run(self, self.ffn_sublayer, x, input_ids)
        return self.ffn_sublayer(x, input_ids)

    def ffn_sublayer(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The FFN site: streams x [T, n, d] and the tokens [T] (hash routing) -> streams [T, n, d]. Static shapes
        and no host reads: CUDA-graph safe."""
        return self.site(x, lambda u: self.ffn(u, input_ids, split=True), "ffn", self.ffn_norm)

    def site(self, x: torch.Tensor, f: Callable, site: str, norm: Norm) -> torch.Tensor:
        """``mhc_same_site_sublayer(x, f, self.mhc(site), self.hc, norm=norm.fused)``. A decode-size call on CUDA
        (at most SPLIT_SITE_MAX_TOKENS tokens, outside batch-invariant mode) makes the sublayer's input from the
        site's pre rows alone (``mhc_pre_collapse_rms_norm``: n of the (2+n)n mixes, no Sinkhorn, pre / collapse /
        norm in one kernel) and the coefficients the expand needs (post, comb) on a side lane beside the sublayer:
        V4's mHC chain before each sublayer loses the Sinkhorn and a launch. The pre of n mixes rounds as its own
        matmul, so results agree with the single-path wiring to fp32 rounding, not bitwise."""
        params = self.mhc(site)
        if not x.is_cuda or x.shape[0] > SPLIT_SITE_MAX_TOKENS or batch_invariant():
            return mhc_same_site_sublayer(x, f, params, self.hc, norm=norm.fused)
        n = x.shape[1]

        def sublayer_input() -> torch.Tensor:
            return mhc_pre_collapse_rms_norm(
                x, params.fn[:n], params.base[:n], params.scale[:1], norm.weight,
                norm_eps=self.hc.norm_eps, hc_eps=self.hc.hc_eps, eps=norm.eps,
            )  # fmt: skip

        # its own lane: the sublayer's branches on the layer lane do not queue behind the coefficients
        return self.site_beside(x, site, sublayer_input, f, lane="mhc")[0]


class MTPLayer(Block):
    """``mtp.I`` (section A.9; the drafting around it: ``deepseek_v4_mtp``): a sliding-window block with a biased
    router, fed X0_j = h_proj(hnorm(X_main_j)) + e_proj(enorm(embed(next token))) per stream j, with its own mHC
    head and final norm; embedding and LM head are the backbone's."""

    def __init__(self, cfg: DeepseekV4Config, index: int, dtype: torch.dtype):
        super().__init__(cfg, cfg.num_hidden_layers + index, dtype, kind=SLIDING)  # past the hash-routed layers
        d, n = cfg.hidden_size, cfg.hc_mult
        self.cfg = cfg
        self.e_proj = Linear(d, d, dtype)
        self.h_proj = Linear(d, d, dtype)
        self.enorm = Norm(d, cfg.rms_norm_eps)
        self.hnorm = Norm(d, cfg.rms_norm_eps)
        self.norm = Norm(d, cfg.rms_norm_eps)
        self.hc_head_fn = param(n, n * d, dtype=torch.float32)
        self.hc_head_base = param(n, dtype=torch.float32)
        self.hc_head_scale = param(1, dtype=torch.float32)

    def run(self, streams, embeds, ids, positions, windows, starts: list[int] | None = None):
        """streams [T, n, d] (X_main), embeds [T, d] of the next tokens ``ids`` [T], positions per request (RoPE
        position i for the row of X_main at i; ``starts`` their first as host ints) -> output streams [T, n, d];
        each window ring advances. The embedding is zeroed at position 0 (vLLM's convention)."""
        pos = torch.cat(positions)
        e = self.enorm(torch.where((pos == 0)[:, None], 0, embeds))
        return self(self.h_proj(self.hnorm(streams)) + self.e_proj(e)[:, None, :], ids, positions, windows, starts)

    def logits(self, streams: torch.Tensor, head: Linear) -> torch.Tensor:
        """Output streams [T, n, d] -> fp32 logits [T, V] through this layer's mHC head and norm."""
        return head_logits(streams, (self.hc_head_fn, self.hc_head_base, self.hc_head_scale), self.norm, head, self.cfg)


class MarkovHead(nn.Module):
    """DSpark's Markov factors: ``markov_w1`` [V, R] embeds the previous draft, ``markov_w2`` [V, R] maps it to a
    vocabulary bias."""

    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype):
        super().__init__()
        v, r = cfg.vocab_size, cfg.dspark.markov_rank
        self.markov_w1 = nn.Module()
        self.markov_w1.weight = param(v, r, dtype=dtype)
        self.markov_w2 = nn.Module()
        self.markov_w2.weight = param(v, r, dtype=dtype)


class DSparkStage(Block):
    """DSpark stage ``mtp.S`` of V4-Flash-0731 (vLLM 0.33's ``DSparkDeepseekV4Model``): a sliding-window block with a
    biased router at layer index num_hidden_layers + S. Its context keys are its own ``window_kv`` of the target
    feature main_x = main_norm(main_proj(concat of the tap streams' means)) (stage 0 holds main_proj / main_norm);
    block rows attend to the last W context keys and to every block row. The last stage holds the head: its mHC
    head ``hc_head_*`` collapses the streams to the pre-norm hidden h; base logits = head(norm(h)); the Markov
    head; and, when the checkpoint has one, the confidence head."""

    def __init__(self, cfg: DeepseekV4Config, stage: int, dtype: torch.dtype, confidence_head: bool = True):
        super().__init__(cfg, cfg.num_hidden_layers + stage, dtype, kind=SLIDING)  # past the hash-routed layers
        d, n, spec = cfg.hidden_size, cfg.hc_mult, cfg.dspark
        self.cfg = cfg
        if stage == 0:
            self.main_proj = Linear(len(spec.target_layer_ids) * d, d, dtype)
            self.main_norm = Norm(d, cfg.rms_norm_eps)
        if stage == spec.num_stages - 1:
            self.norm = Norm(d, cfg.rms_norm_eps)
            self.hc_head_fn = param(n, n * d, dtype=torch.float32)
            self.hc_head_base = param(n, dtype=torch.float32)
            self.hc_head_scale = param(1, dtype=torch.float32)
            self.markov_head = MarkovHead(cfg, dtype)
            if confidence_head:
                self.confidence_head = nn.Module()
                self.confidence_head.proj = Linear(d + spec.markov_rank, 1, torch.float32)

    def block_attention(self, x: torch.Tensor, *, pos: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x [N, d] normed block rows at ``pos``; ctx [C, D] this stage's context keys before pos[0] (C <= W)."""
        a = self.attn
        _, q = a.query(x, pos)
        kv = torch.cat([ctx, a.window_kv(x, pos)])
        ids = draft_block_key_ids(self.cfg.sliding_window, ctx.shape[0], x.shape[0], x.device)
        o = sparse_mqa_attention(q, kv, ids[None].expand(x.shape[0], -1), a.attn_sink, a.head_dim**-0.5)
        return a.output(o, pos)

    def head_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Streams [T, n, d] -> the pre-norm hidden h [T, d] (mHC head collapse)."""
        pre = mhc_head_weights(
            x,
            self.hc_head_fn,
            self.hc_head_base,
            self.hc_head_scale,
            norm_eps=self.cfg.rms_norm_eps,
            hc_eps=self.cfg.hc_eps,
        )
        return mhc_collapse(x, pre)


class DeepseekV4ForCausalLM(nn.Module):
    """The V4-Flash backbone; with ``mtp`` also its MTP layers (speculative method "mtp"), with ``dspark`` the DSpark
    stages of a V4-Flash-0731 checkpoint (method "dspark"; ``confidence_head``: whether it ships one). Either
    draft head lives in ``self.mtp`` (the checkpoint's ``mtp.*``); ``draft_method`` names it. Logits are fp32."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        dtype: torch.dtype = torch.bfloat16,
        mtp: bool = False,
        dspark: bool = False,
        confidence_head: bool = True,
    ):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        n, d = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Module()
        self.embed.weight = param(cfg.vocab_size, d, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size, dtype)
        self.hc_head_fn = param(n, n * d, dtype=torch.float32)
        self.hc_head_base = param(n, dtype=torch.float32)
        self.hc_head_scale = param(1, dtype=torch.float32)
        self.mtp, self.draft_method = None, None
        self.step_graphs: StepGraphs | None = None  # set by enable_cuda_graphs
        if mtp and dspark:
            raise ValueError("build either the MTP layers (mtp) or the DSpark stages (dspark): both live in mtp.*")
        if mtp:
            if cfg.dspark is not None:
                raise ValueError(
                    "this checkpoint's mtp.* are DSpark stages (V4-Flash-0731): use speculative method 'dspark'"
                )
            if cfg.num_nextn_predict_layers < 1:
                raise ValueError("this config has num_nextn_predict_layers = 0: no MTP layer to build")
            self.mtp = nn.ModuleList(MTPLayer(cfg, i, dtype) for i in range(cfg.num_nextn_predict_layers))
            self.draft_method = "mtp"
        if dspark:
            if cfg.dspark is None:
                raise ValueError("this config has no DSpark head (no dspark_target_layer_ids)")
            stages = range(cfg.dspark.num_stages)
            self.mtp = nn.ModuleList(DSparkStage(cfg, s, dtype, confidence_head) for s in stages)
            self.draft_method = "dspark"

    def enable_cuda_graphs(self, max_tokens: int = 64) -> SublayerGraphs:
        """Replay decode steps of at most ``max_tokens`` requests planned as one batch (``plan_decode``) from CUDA
        graphs of the whole step, and the FFN sublayers of other steps of at most ``max_tokens`` tokens
        (``cuda_graphs``); results stay bitwise those of eager execution."""
        self.step_graphs = StepGraphs(max_tokens)
        return attach_sublayer_graphs(self, Block, max_tokens)

    def slot_specs(self, backtrack: int = 0) -> list[SlotSpec]:
        """The fixed-size buffers of one request (``slot_pool``), rings sized for a rollback of B tokens; with MTP
        layers also their drafting state's rings."""
        return v4_slot_specs(
            self.cfg, self.dtype, backtrack, mtp=self.draft_method == "mtp", dspark=self.draft_method == "dspark"
        )

    def new_cache(
        self, new_rows: RowFactory | None = None, backtrack: int = 0, slots: SlotState | None = None
    ) -> SequenceCache:
        """An empty request cache over ``slots`` (a request slot of a pool of ``slot_specs(backtrack)``, by default
        a private one); ``new_rows`` makes its entry stores (default: standalone tensors); ``backtrack`` B sizes
        the rings so that ``rollback_cache`` can undo up to B tokens."""
        if slots is None:
            slots = SlotPool.private(self.slot_specs(backtrack), self.embed.weight.device)
        return SequenceCache.empty(self.cfg, slots, new_rows, backtrack)

    def restore_cache(self, snap: CacheSnapshot, new_rows: RowFactory, backtrack: int = 0) -> SequenceCache:
        """A cache continuing from prefix snapshot ``snap`` (copied into a new request slot of its pool)."""
        return SequenceCache.restore(self.cfg, snap, new_rows, backtrack)

    def rollback_cache(self, cache: SequenceCache, num_tokens: int, token_ids=None) -> None:
        """Undo the last ``num_tokens`` tokens of ``cache`` (rejected drafts; at most its backtrack B).
        ``token_ids`` is accepted for interface parity with V4.1 (V4's state needs no token ids)."""
        cache.rollback(num_tokens)
        if cache.mtp is not None:
            cache.mtp.truncate(cache.seq_len)

    def growing_ratios(self) -> set[int]:
        """Compression ratios of the growing cache kinds (an engine block must hold whole groups)."""
        return {m.ratio for m in self.modules() if isinstance(m, Compressor)}

    def prefix_replay_tokens(self) -> int:
        """Tokens a prefix hit must leave to recompute: the row whose logits come next."""
        return 1

    def cache_layout(self, backtrack: int = 0) -> CacheLayout:
        return v4_cache_layout(
            self.cfg, self.dtype, backtrack, mtp=self.draft_method == "mtp", dspark=self.draft_method == "dspark"
        )

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, caches: list[SequenceCache]) -> torch.Tensor:
        """Run input_ids [B, S] as the next S tokens of B requests; logits [B, S, V] fp32.

        Each request's cache advances by S; a fresh cache makes this a full forward.
        """
        if input_ids.dim() != 2 or len(caches) != input_ids.shape[0]:
            raise ValueError(
                f"need input_ids [B, S] and one cache per request; got {tuple(input_ids.shape)}, {len(caches)} caches"
            )
        return torch.stack(self.forward_step(list(input_ids), caches))

    @torch.no_grad()
    def forward_step(
        self,
        chunks: list[torch.Tensor],
        caches: list[SequenceCache],
        prompt_lens: list[int | None] | None = None,
        logit_rows: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """One engine step: request i runs its next ``chunks[i]`` tokens ([S_i] int64; lengths may differ).

        Returns per request the fp32 logits [n_i, V] of ``logit_rows[i]`` (offsets into the chunk; None =
        every row). ``prompt_lens`` is accepted for interface parity with V4.1 (V4 has no truncation).
        """
        if len(caches) != len(chunks):
            raise ValueError(f"need one cache per request: {len(caches)} caches for {len(chunks)} chunks")
        dev = self.embed.weight.device
        ids = torch.cat(chunks).to(dev)
        batch = self.plan_decode(chunks, caches)
        if batch is not None:
            logits = batch.run(ids, self._decode_rows)
            for c in caches:
                c.seq_len += 1
            return batch.per_request(logits, logit_rows)
        starts = [c.seq_len for c in caches]
        positions = [torch.arange(s, s + ch.shape[0], device=dev) for s, ch in zip(starts, chunks)]
        x = embed_streams(self.embed.weight, ids, self.cfg.hc_mult)
        taps = {} if self.draft_method == "dspark" else None
        for i, layer in enumerate(self.layers):
            if taps is not None and i in self.cfg.dspark.target_layer_ids:
                taps[i] = x.float().mean(dim=1).to(x.dtype)
            x = layer(x, ids, positions, [c.layers[i] for c in caches], starts)
        if taps is not None:
            if len(self.layers) in self.cfg.dspark.target_layer_ids:
                taps[len(self.layers)] = x.float().mean(dim=1).to(x.dtype)
            self._write_dspark_context(taps, positions, caches)
        # logits only for the rows asked for, all requests in one head call (row ids built on the host)
        picked, sizes, start = [], [], 0
        for j, (c, ch) in enumerate(zip(caches, chunks)):
            n = ch.shape[0]
            if c.mtp is not None:  # the MTP layer drafts from these streams once the next tokens are known
                c.mtp.push(x[start : start + n], c.seq_len)
            c.seq_len += n
            want = range(n) if logit_rows is None or logit_rows[j] is None else logit_rows[j].tolist()
            picked += [start + r for r in want]
            sizes.append(len(want))
            start += n
        hc = (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return list(head_logits(x[long_tensor(picked, dev)], hc, self.norm, self.head, self.cfg).split(sizes))

    def plan_decode(self, chunks: list[torch.Tensor], caches: list[SequenceCache]) -> DecodeBatch | None:
        """The plan of a decode step run as one batch (``decode_batch``), or None where the general path runs: a
        step with a chunk of other than one token, requests outside one slot pool or one engine's paged pools, or a
        model with a draft head (whose drafting reads the backbone's streams per request)."""
        if self.draft_method is not None or any(ch.shape[0] != 1 for ch in chunks) or not caches:
            return None
        pool = caches[0].slots.pool
        if any(c.slots.pool is not pool for c in caches):
            return None
        plans = v4_compressors(self.cfg)
        if [s.key for s in caches[0].compressor_states] != list(plans):
            raise RuntimeError("cache compressors do not follow the model's v4_compressors order")
        # each request's paged stores in that order, transposed across the batch (in C: 65 a request at full depth)
        stores = list(zip(*(c.step_stores for c in caches)))
        # a request's stores all come from its cache's one row factory: its first one says whether all are paged
        kv_pools = paged_stores(stores[0]) if plans else None
        if plans and kv_pools is None:
            return None
        dev = self.embed.weight.device
        batch = DecodeBatch([c.seq_len for c in caches], [c.slots.slot for c in caches], pool, self.step_graphs)
        batch.plan_ring([("window", i) for i in range(len(self.layers))], self.cfg.sliding_window - 1)
        kinds: dict[tuple[int, int], list] = {}  # compressors of one kind (ratio, rows looked back) move together
        for key, plan in plans.items():
            kinds.setdefault((plan.ratio, plan.ring_rows(0)), []).extend([(*key, "kv"), (*key, "score")])
        for (_, back), keys in kinds.items():  # back: the group's other rows and, with overlap, the previous window
            batch.plan_ring(keys, back)
        appends: dict[int, tuple[dict, dict]] = {}  # ratio -> (stores, entry widths) by compressor
        for j, (key, plan) in enumerate(plans.items()):
            group, widths = appends.setdefault(plan.ratio, ({}, {}))
            group[key], widths[key] = stores[j], plan.width - plan.prev_width
        for ratio, (group, widths) in appends.items():
            batch.plan_append(group, ratio, widths, self.dtype)
        batch.plan_positions(plan.ratio for plan in plans.values())
        if plans:
            batch.plan_tables([s.table for s in stores[0]], kv_pools.block_size, bucket=batch.graphs is not None)
        return batch.seal(dev)

    def _decode_rows(self, batch: DecodeBatch, ids: torch.Tensor) -> torch.Tensor:
        """The device work of a planned decode step (static shapes, no host reads): ids [rows] -> logits [rows, V];
        replayed from a CUDA graph where ``enable_cuda_graphs`` was called (``DecodeBatch.run``)."""
        x = embed_streams(self.embed.weight, ids, self.cfg.hc_mult)
        for layer in self.layers:
            x = layer.decode(x, ids, batch)
        hc = (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        return head_logits(x, hc, self.norm, self.head, self.cfg)

    def dspark_feature(self, taps: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target feature main_x [T, d] = main_norm(main_proj(concat of the tap layers' stream means))."""
        s0 = self.mtp[0]
        return s0.main_norm(s0.main_proj(torch.cat([taps[t] for t in self.cfg.dspark.target_layer_ids], dim=-1)))

    def _write_dspark_context(self, taps, positions: list[torch.Tensor], caches: list[SequenceCache]) -> None:
        """Each stage's context keys of the step's rows (they follow each request's ``ctx_end``)."""
        feat, start = self.dspark_feature(taps), 0
        for pos, c in zip(positions, caches):
            rows = feat[start : start + pos.numel()]
            start += pos.numel()
            if not pos.numel():
                continue
            for k, stage in enumerate(self.mtp):
                c.dspark_ctx[k].write(c.ctx_end, stage.attn.window_kv(rows, pos))
            c.ctx_end += pos.numel()

    @property
    def dspark_block_size(self) -> int:
        return self.cfg.dspark.block_size

    def dspark_markov(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(W1 [V, R], W2 [V, R], confidence weight [1, d + R] or None without a confidence head)."""
        last = self.mtp[-1]
        conf = last.confidence_head.proj.weight if hasattr(last, "confidence_head") else None
        return last.markov_head.markov_w1.weight, last.markov_head.markov_w2.weight, conf

    @torch.no_grad()
    def dspark_hidden(self, anchors: torch.Tensor, caches: list[SequenceCache]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's draft block: rows [anchor, noise x (N - 1)] at positions a .. a + N - 1 (a = the cache's
        seq_len) through the stages, each over its last W context keys and all block rows.

        Returns (base logits fp32 [B, N, V] = head(norm(h)), pre-norm hiddens h [B, N, d]) for
        ``deepinfer_spec.markov_drafts``.
        """
        if self.draft_method != "dspark":
            raise ValueError("this model was built without its DSpark stages (dspark=True)")
        spec, last = self.cfg.dspark, self.mtp[-1]
        bases, hiddens = [], []
        for anchor, cache in zip(anchors.tolist(), caches):
            pos, ids, x = draft_block_inputs(
                anchor, cache, spec.block_size, spec.noise_token_id, self.embed.weight, self.cfg.hc_mult
            )
            for k, stage in enumerate(self.mtp):
                ring = cache.dspark_ctx[k]
                ctx = ring.read(max(ring.lo, ring.end - self.cfg.sliding_window), ring.end)
                x = stage.run_block(x, ids, partial(stage.block_attention, pos=pos, ctx=ctx))
            h = last.head_hidden(x)
            bases.append(linear(last.norm(h), self.head.weight, out_dtype=torch.float32))
            hiddens.append(h)
        return torch.stack(bases), torch.stack(hiddens)

    @torch.no_grad()
    def draft_mtp(
        self,
        states: list[MTPState],
        token_ids: list[Callable[[int, int], list[int]]],
        anchors: list[int],
        num_drafts: int,
        sample: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> None:
        """Draft ``num_drafts`` tokens after each request's anchor with MTP layer 0 (chained on itself).

        Request b's anchor (its newest token, not yet run by the backbone) sits at position ``anchors[b]``; its
        state holds the backbone streams up to anchors[b] - 1 and ``token_ids[b](start, stop)`` gives its tokens.
        First the rows the layer has not run yet (next tokens known, the anchor the last of them); then each
        draft: ``sample(j, logits fp32 [B, V])`` returns draft j (int64 [B], position anchor + 1 + j), which the
        next chained row embeds. The chained rows leave the window rings again (they were drafts).
        """
        layer, dev = self.mtp[0], self.embed.weight.device
        streams, ids, positions, starts = [], [], [], []
        for st, tokens, a in zip(states, token_ids, anchors):
            rows, first = st.take(a, self.cfg.hc_mult)
            streams.append(rows)
            positions.append(torch.arange(first, a, device=dev))
            starts.append(first)
            ids += tokens(first + 1, a + 1)
            st.seq_len = a
        windows = [st.window for st in states]
        flat = long_tensor(ids, dev)
        x = layer.run(torch.cat(streams), self.embed.weight[flat], flat, positions, windows, starts)
        ends = torch.tensor([a - first for a, first in zip(anchors, starts)]).cumsum(0) - 1
        x = x[long_tensor(ends.tolist(), dev)]  # each request's last row (the anchor's)
        for j in range(num_drafts):
            drafts = sample(j, layer.logits(x, self.head))
            if j + 1 < num_drafts:
                pos = [torch.arange(a + j, a + j + 1, device=dev) for a in anchors]
                x = layer.run(x, self.embed.weight[drafts], drafts, pos, windows, [a + j for a in anchors])
        for st in states:
            st.drop_chained(num_drafts - 1)

    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full forward of input_ids [B, S] (LongTensor) from position 0: float logits [B, S, V]."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor [batch, seq]; got {input_ids.dtype}{tuple(input_ids.shape)}"
            )
        bad = (input_ids < 0) | (input_ids >= self.cfg.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(input_ids[bad][0])} outside the vocabulary [0, {self.cfg.vocab_size})")
        return self.forward(input_ids.long(), [self.new_cache() for _ in range(input_ids.shape[0])])


def v4_cache_layout(
    cfg: DeepseekV4Config, dtype: torch.dtype, backtrack: int = 0, mtp: bool = False, dspark: bool = False
) -> CacheLayout:
    """Bytes of the reference model's per-request state, by cache kind (latents kept in ``dtype``): what one slot of
    the ``slot_pool`` holds. ``backtrack`` B: the rings' extra rows for speculative rollback. ``mtp``: the MTP
    layer's window ring and the backbone streams it drafts from (``deepseek_v4_mtp``). ``dspark``: the DSpark
    stages' context rings."""
    e = torch.finfo(dtype).bits // 8
    w, d, dh, b = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, backtrack
    kinds = [cfg.layer_types[i] for i in range(cfg.num_hidden_layers)]
    r_csa, r_hca = cfg.compress_rates[CSA], cfg.compress_rates[HCA]
    n_csa, n_hca = kinds.count(CSA), kinds.count(HCA)
    # fp32 rings of projected rows (kv + score): CSA (compressor of width 2d, indexer of width 2dh) the group's
    # ratio rows, the previous window's ratio rows (its A-halves feed the next group) and B; HCA ratio + B
    csa_state = (2 * r_csa + b) * 2 * (2 * d + 2 * dh) * 4
    hca_state = (r_hca + b) * 2 * d * 4
    kinds = [
        CacheKind("window latents", 0, cfg.num_hidden_layers * (w + b) * d * e),
        CacheKind("compressed KV (CSA)", n_csa * d * e / r_csa, 0),
        CacheKind("index keys (CSA)", n_csa * dh * e / r_csa, 0),
        CacheKind("compressed KV (HCA)", n_hca * d * e / r_hca, 0),
        CacheKind("compressor state (fp32)", 0, n_csa * csa_state + n_hca * hca_state),
    ]
    if mtp:
        kinds += [
            CacheKind("MTP window latents", 0, (w - 1 + b) * d * e),
            CacheKind("MTP backbone streams", 0, (w + b) * cfg.hc_mult * cfg.hidden_size * e),
        ]
    if dspark:
        kinds.append(CacheKind("DSpark context", 0, cfg.dspark.num_stages * (w + b) * d * e))
    return CacheLayout(tuple(kinds))

"""Context-parallel prefill of one request through a DeepSeek-V4 model (``models/deepseek_v4.py``).

Each CP rank runs the token-wise work (embedding, mHC, norms, projections, the MoE through EP) for its zigzag
positions only, and at each attention sublayer:

- the key side (window latents, compressor and indexer-compressor state) is computed from the *gathered* normed
  inputs of all positions, so every CP rank's cache ends complete and equal to a single-process prefill;
- the query side (queries, indexer scores / top-k, sparse attention, output projection) runs for the rank's own
  positions only: the balanced part (zigzag gives each rank the same causal work).

The attention code mirrors ``Attention.forward`` / ``_attend_one`` / ``Indexer.forward`` of the model with the
query rows restricted; every primitive is row-invariant, so outputs are bitwise those of a single process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_kernels import (
    indexer_scores,
    indexer_topk,
    mhc_same_site_sublayer,
    sparse_mqa_attention,
)

from deepinfer_runtime.distributed.cp_comm import gather_in_order
from deepinfer_runtime.models.deepseek_v4 import Attention
from deepinfer_runtime.models.deepseek_v4_cache import LayerCache, SequenceCache
from deepinfer_runtime.models.deepseek_v4_config import CSA, SLIDING
from deepinfer_runtime.models.layers import embed_streams


def _attention(
    attn: Attention,
    u: torch.Tensor,
    pos: torch.Tensor,
    owned: list[torch.Tensor],
    cache: LayerCache,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """u [n_r, d] normed inputs at this rank's positions ``pos`` -> attention output [n_r, d]."""
    cfg = attn.cfg
    u_all = gather_in_order(u, owned, group)  # [S, d], positions 0 .. S-1 of this chunk
    pos_all = torch.arange(u_all.shape[0], device=u.device)  # a fresh request: the chunk starts at 0
    qr, q = attn.query(u, pos)
    kv = attn.window_kv(u_all, pos_all)
    win = cfg.sliding_window
    rows, base = cache.append_window(kv, win, int(pos_all[0]))
    key_pos = pos[:, None] - win + 1 + torch.arange(win, device=u.device)
    idx = torch.where(key_pos >= 0, key_pos - base, -1)
    kv_all = rows
    if attn.kind != SLIDING:
        entries = attn.compressor(u_all, pos_all, cache.compressor, attn.inv_freq)
        if attn.kind == CSA:
            ix = attn.indexer
            keys = ix.compressor(u_all, pos_all, cache.indexer, attn.inv_freq)
            qi, weights = ix.query(u, qr, pos, attn.inv_freq)
            visible = ((pos + 1) // ix.ratio)[None]
            scores = indexer_scores(qi[None], keys[None], weights[None], ix.head_dim**-0.5, visible)
            picked = indexer_topk(scores, visible, ix.topk)[0]
        else:  # HCA: every complete window is visible
            ids = torch.arange(entries.shape[0], device=u.device)
            picked = torch.where(ids[None] < ((pos + 1) // attn.compressor.ratio)[:, None], ids[None], -1)
        idx = torch.cat([idx, torch.where(picked >= 0, picked + rows.shape[0], -1)], dim=1)
        kv_all = torch.cat([rows, entries.to(rows.dtype)])
    return attn.output(sparse_mqa_attention(q, kv_all, idx, attn.attn_sink, attn.head_dim**-0.5), pos)


@torch.no_grad()
def cp_prefill_v4(
    model, ids: torch.Tensor, cache: SequenceCache, owned: list[torch.Tensor], cp_rank: int, group
) -> None:
    """Run ``ids`` [S] (a fresh request's first S tokens) through ``model`` with CP; ``cache`` ends as after a
    single-process prefill of them. ``owned[q]``: positions of CP rank q (a zigzag assignment). No logits."""
    if cache.seq_len:
        raise ValueError("cp_prefill_v4: the CP prefill starts a fresh request")
    dev = model.embed.weight.device
    pos = owned[cp_rank].to(dev)
    my_ids = ids.to(dev)[pos]
    x = embed_streams(model.embed.weight, my_ids, model.cfg.hc_mult)
    for i, block in enumerate(model.layers):
        layer_cache = cache.layers[i]
        x = mhc_same_site_sublayer(
            x,
            lambda u, b=block, c=layer_cache: _attention(b.attn, u, pos, owned, c, group),
            block.mhc("attn"),
            block.hc,
            norm=block.attn_norm.fused,
        )
        x = mhc_same_site_sublayer(
            x, lambda u, b=block: b.ffn(u, my_ids), block.mhc("ffn"), block.hc, norm=block.ffn_norm.fused
        )
    cache.seq_len += ids.shape[0]

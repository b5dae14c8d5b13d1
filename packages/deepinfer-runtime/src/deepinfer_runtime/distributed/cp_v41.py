"""Context-parallel prefill of one request through a DeepSeek-V4.1 model (``models/deepseek_v41.py``).

Same split as ``cp_v4.py``: token-wise work (embedding, Engram, mHC, MoE through EP, DSpark taps) on this CP
rank's zigzag positions; at each attention sublayer the key side (window latents, compressor / index-key
publication) from the gathered inputs of every position, the query side (queries, indexer scores, top-k,
candidates, sparse attention) for this rank's positions only. YOCO truncation as the model does it for a prefill
chunk with prompt length L: decoder windows floored at L - keep; in compact mode the decoder runs on the rows at
or after the floor (on each rank, its own such rows) while the boundary compressor still reads every row.

``_attention`` mirrors ``Attention.forward_chunk`` with the query rows restricted, and ``cp_prefill_v41`` mirrors
``DeepseekV41ForCausalLM.forward_step`` for one fresh request; all primitives are row-invariant, so the cache
is bitwise the one a single-process prefill leaves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_kernels import engram_next_history, mhc_initial_pre_mix

from deepinfer_runtime.distributed.cp_comm import gather_in_order
from deepinfer_runtime.models.deepseek_v41 import Attention, V41SequenceCache
from deepinfer_runtime.models.layers import embed_streams


def _attention(
    attn: Attention,
    u: torch.Tensor,
    pos: torch.Tensor,
    owned: list[torch.Tensor],
    comp: tuple[torch.Tensor, torch.Tensor] | None,
    cache: V41SequenceCache,
    floor: int | None,
    shared: dict,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """u [n_r, d] normed inputs at this rank's positions ``pos``; ``comp`` = (all rows' compressor inputs,
    their positions), gathered, at the compact-YOCO boundary layer, else None. -> [n_r, d]."""
    u_all = gather_in_order(u, owned, group)
    pos_all = torch.sort(torch.cat(owned)).values.to(u.device)
    if attn.kv_source == attn.layer:
        xc, pc = comp if comp is not None else (u_all, pos_all)
        attn.feed_compressor(xc, pc, cache.source(attn.layer, attn.ratio))
    if not pos_all.numel():
        return u.new_zeros(0, attn.cfg.hidden_size)
    qr, q = attn.query(u, pos)
    # the window rows of every position: the cache needs them all
    rows, first = attn.append_window(cache, attn.window_kv(u_all, pos_all), int(pos_all[0]))
    if not pos.numel():  # none of this rank's rows run here (compact YOCO tail on another rank)
        return u.new_zeros(0, attn.cfg.hidden_size)
    return attn.attend_cached(u, qr, q, rows, first, pos, floor, cache, shared)


@torch.no_grad()
def cp_prefill_v41(
    model,
    ids: torch.Tensor,
    cache: V41SequenceCache,
    owned: list[torch.Tensor],
    cp_rank: int,
    group: dist.ProcessGroup,
    prompt_len: int,
) -> None:
    """Run ``ids`` [S] (a fresh request's first S prompt tokens, prompt length ``prompt_len`` for YOCO) through
    ``model`` with CP; ``cache`` ends as after a single-process prefill chunk of them. No logits."""
    cfg = model.cfg
    if cache.seq_len:
        raise ValueError("cp_prefill_v41: the CP prefill starts a fresh request")
    dev = model.embed.weight.device
    ids = ids.to(dev)
    owned = [p.to(dev) for p in owned]
    pos = owned[cp_rank]
    floor = max(prompt_len - model.yoco_keep, 0) if model.yoco_mode != "off" else None
    engram = {layer: e[pos] for layer, e in model.engram_ids(ids, None).items()}  # hashes need the n-gram context
    x = embed_streams(model.embed.weight, ids[pos], cfg.hc_mult)
    pre_mix = mhc_initial_pre_mix(x.shape[0], cfg.hc_mult, dev)
    shared: dict = {}
    taps: dict[int, torch.Tensor] = {}
    kept = torch.ones(pos.shape[0], dtype=torch.bool, device=dev)  # this rank's rows still running
    for block in model.layers:
        layer = block.layer
        comp = None
        if layer == cfg.n_prefill_layer and model.yoco_mode == "compact" and floor:
            # boundary: its compressor reads every row; the decoder runs on rows at or after the floor only
            comp_in = gather_in_order(block.attn_norm.collapse(x, pre_mix), owned, group)
            comp = (comp_in, torch.cat(owned).sort().values)
            kept = pos >= floor
            x, pre_mix = x[kept], pre_mix[kept]
            owned = [p[p >= floor] for p in owned]
        my_pos = owned[cp_rank]
        if hasattr(block, "engram"):
            x = block.engram(x, engram[layer][kept])
        if layer in cfg.dspark_target_layer_ids:
            taps[layer] = x.float().mean(dim=1).to(x.dtype)
        decoder_floor = floor if layer >= cfg.n_prefill_layer else None

        def attn_fn(u, block=block, comp=comp, my_pos=my_pos, owned=owned, floor=decoder_floor):
            return _attention(block.attn, u, my_pos, owned, comp, cache, floor, shared, group)

        x, pre_mix = block.run(x, pre_mix, attn_fn)
    if model.mtp and taps:
        feats = model.dspark_feature([taps[t] for t in cfg.dspark_target_layer_ids])
        pos = torch.cat(owned).sort().values
        model._write_dspark_context(gather_in_order(feats, owned, group), pos, cache, cache.seq_len)
    cache.engram_history = engram_next_history(
        model.engram_token_map[ids][None], cache.engram_history, cfg.engram_max_ngram_size
    )
    cache.seq_len += ids.shape[0]

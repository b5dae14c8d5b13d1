"""The definition of correct for DeepSeek-V4.1-Flash: a slow full recompute, straight from the spec.

``reference_forward`` runs every layer over a whole sequence at once, with no caches, no chunking and no
state carried between calls: compressed entries and index keys are rebuilt from all rows, every query's
visibility is written out from its position. It calls the same row-invariant primitives as the model's
incremental path (``DeepseekV41ForCausalLM.forward``), so the two must agree bitwise in float32 for any
chunking of the same prompt; the model_v41 tests check exactly that.

YOCO truncation (decisions Y1-Y4) with prompt length L and keep K: ``mask`` floors every decoder layer's
window at L - K for all rows; ``compact`` additionally drops decoder rows before L - K (NaN logits) while
the boundary layer's compressor still reads every row.
"""

from __future__ import annotations

import torch
from deepinfer_kernels import mhc_collapse, mhc_initial_pre_mix

from deepinfer_runtime.models.deepseek_v41 import TRUNCATION_MODES, DeepseekV41ForCausalLM


@torch.no_grad()
def reference_forward(
    model: DeepseekV41ForCausalLM,
    input_ids: torch.Tensor,
    yoco_mode: str = "off",
    keep: int | None = None,
    prompt_len: int | None = None,
) -> torch.Tensor:
    """Logits [B, S, V] fp32 for input_ids [B, S] (positions 0 .. S-1).

    With truncation, the first ``prompt_len`` tokens (default all S) are the prompt: the decoder window
    floor is prompt_len - keep. Rows after the prompt (decode steps) are never affected by the floor
    because keep >= window + backtracking.
    """
    if yoco_mode not in TRUNCATION_MODES:
        raise ValueError(f"yoco_mode {yoco_mode!r} must be one of {TRUNCATION_MODES}")
    keep = model.yoco_keep if keep is None else keep
    return torch.stack([_one(model, ids, yoco_mode, keep, prompt_len)[0] for ids in input_ids])


@torch.no_grad()
def reference_draft_block(model: DeepseekV41ForCausalLM, input_ids: torch.Tensor, anchor: int):
    """Greedy DSpark block (tokens [N], confidences [N]) after the prompt input_ids [S] and its anchor
    token at position S, rebuilt from a full reference run (procedure D of model_v41_decisions.md)."""
    cfg = model.cfg
    s = input_ids.shape[0]
    _, taps = _one(model, input_ids, "off", 0, None)
    feats = model.dspark_feature([taps[t] for t in cfg.dspark_target_layer_ids])
    ctx_pos = torch.arange(max(s - cfg.sliding_window, 0), s, device=input_ids.device)
    n = cfg.dspark_block_size
    pos = torch.arange(s, s + n, device=input_ids.device)
    block_ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (n - 1), device=input_ids.device)
    x = model.embed.weight[block_ids][:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    pre_mix = mhc_initial_pre_mix(n, cfg.hc_mult, input_ids.device)
    for stage in model.mtp:
        ctx = stage.attn.window_kv(feats[ctx_pos], ctx_pos)
        x, pre_mix = stage.run(x, pre_mix, lambda u, st=stage, c=ctx: st.block_attention(u, pos=pos, ctx=c))
    last = model.mtp[-1]
    h = mhc_collapse(x, pre_mix)
    base = torch.nn.functional.linear(last.norm(h).float(), model.head.weight.float())
    w1, w2 = last.markov_head.embed.weight.float(), last.markov_head.head.weight.float()
    prev, toks, confs = anchor, [], []
    for k in range(n):
        m = w1[prev]
        conf = torch.cat([h[k].float(), m]) @ last.confidence_head.proj.weight.float()[0]
        confs.append(torch.sigmoid(conf.clamp(-60, 60)))
        prev = int((base[k] + w2 @ m).argmax())
        toks.append(prev)
    return torch.tensor(toks), torch.stack(confs)


def _one(model: DeepseekV41ForCausalLM, ids: torch.Tensor, mode: str, keep: int, prompt_len: int | None):
    """Logits [S, V] and the stream means entering the DSpark tap layers ({layer: [rows, d]})."""
    cfg = model.cfg
    s = ids.shape[0]
    pos = torch.arange(s, device=ids.device)
    floor = None if mode == "off" else max((s if prompt_len is None else prompt_len) - keep, 0)
    taps: dict[int, torch.Tensor] = {}
    engram = model.engram_ids(ids, None)
    x = model.embed.weight[ids][:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    pre_mix = mhc_initial_pre_mix(s, cfg.hc_mult, ids.device)
    rows = torch.ones(s, dtype=torch.bool, device=ids.device)  # rows still computed
    published: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # kv source -> (entries, keys)
    topk: dict[int, torch.Tensor] = {}
    candidates = None
    comp_input = None
    for block in model.layers:
        layer, a = block.layer, block.attn
        decoder = layer >= cfg.n_prefill_layer
        if decoder and layer == cfg.n_prefill_layer and mode == "compact":
            comp_input = block.attn_norm(mhc_collapse(x, pre_mix))  # every row feeds the boundary compressor
            rows = pos >= floor
            x, pre_mix = x[rows], pre_mix[rows]
        p = pos[rows]
        if hasattr(block, "engram"):
            x = block.engram(x, engram[layer][rows])
        if layer in cfg.dspark_target_layer_ids:
            taps[layer] = x.float().mean(dim=1).to(x.dtype)

        boundary_input = comp_input if layer == cfg.n_prefill_layer else None

        def attn_fn(u, a=a, layer=layer, p=p, decoder=decoder, boundary_input=boundary_input):
            nonlocal candidates
            qr, q = a.query(u, p)
            kv = a.window_kv(u, p)
            win = a.window_ids(p, int(p[0]), floor if decoder else None)
            if a.ratio == 0:
                return a.attend(q, kv, None, win, None, p)
            if a.kv_source == layer:
                src_x, src_pos = (u, p) if boundary_input is None else (boundary_input, pos)
                published[layer] = _compress_all(a, src_x, src_pos)
            entries, keys = published[a.kv_source]
            if a.index_source == layer:
                scores = a.index_scores(u, qr, p, keys)
                cand = candidates if a.uses_candidates else None
                if a.is_candidate_source:
                    candidates = a.candidates(scores, p)
                topk[layer] = a.select(scores, p, cand)
            return a.attend(q, kv, entries, win, topk[a.index_source], p)

        x, pre_mix = block.run(x, pre_mix, attn_fn)
    out = torch.full((s, cfg.vocab_size), float("nan"), device=ids.device)
    out[rows] = model.logits(x, pre_mix)
    return out, taps


def _compress_all(a, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All complete groups of a KV source from its attention inputs x [S, d] -> (entries, index keys)."""
    r = a.ratio
    kv, score = a.compressor.project(x)
    if r == 1:
        latent, group_pos = kv, pos
    else:
        groups = x.shape[0] // r
        d = kv.shape[-1]
        latent = a.compressor.pool(kv[: groups * r].view(groups, r, d), score[: groups * r].view(groups, r, d), x.dtype)
        group_pos = torch.arange(groups, device=x.device) * r
    return a.publish(latent, group_pos)

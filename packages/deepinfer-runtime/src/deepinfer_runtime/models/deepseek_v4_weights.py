"""The DeepSeek-V4-Flash checkpoint inventory: every tensor's name, shape and storage role.

One table drives the loader (what must be present, how to decode it) and the tiny-checkpoint
writer (what to emit), so the two cannot drift apart. Names are the released checkpoint's
(``layers.L.attn.wq_a.weight``, with ``.scale`` companions for quantised weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer_runtime.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config

if TYPE_CHECKING:
    from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config

# roles: how a tensor may be stored
LINEAR = "linear"  # FP8 e4m3 + block scales when quantised, else bf16
EXPERT = "expert"  # MXFP4 (or FP8) when quantised, else bf16
BF16, FP32, INT64 = "bf16", "fp32", "int64"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str


def v4_inventory(cfg: DeepseekV4Config) -> list[TensorSpec]:
    """All backbone tensors of a V4 checkpoint (the MTP layers ``mtp.*``: ``v4_mtp_inventory``)."""
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    out = [
        TensorSpec("embed.weight", (v, d), BF16),
        TensorSpec("head.weight", (v, d), BF16),
        TensorSpec("norm.weight", (d,), BF16),
        TensorSpec("hc_head_fn", (n, n * d), FP32),
        TensorSpec("hc_head_base", (n,), FP32),
        TensorSpec("hc_head_scale", (1,), FP32),
    ]
    for layer in range(cfg.num_hidden_layers):
        out += block_specs(cfg, f"layers.{layer}.", cfg.layer_types[layer], cfg.is_hash_layer(layer))
    return out


def core_rows(p: str, cfg: DeepseekV4Config | DeepseekV41Config) -> list[tuple]:
    """(name, shape, role) rows every V4 / V4.1 block has under prefix ``p``: the two norms, the mHC sites and
    the attention core (queries, shared KV, sinks, grouped output projection)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    h, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, orank = cfg.o_groups, cfg.o_lora_rank
    mix = (2 + n) * n
    return [
        (p + "attn_norm.weight", (d,), BF16),
        (p + "ffn_norm.weight", (d,), BF16),
        *[
            (p + f"hc_{s}_{part}", shape, FP32)
            for s in ("attn", "ffn")
            for part, shape in (("fn", (mix, n * d)), ("base", (mix,)), ("scale", (3,)))
        ],
        (p + "attn.attn_sink", (h,), FP32),
        (p + "attn.wq_a.weight", (ql, d), LINEAR),
        (p + "attn.q_norm.weight", (ql,), BF16),
        (p + "attn.wq_b.weight", (h * hd, ql), LINEAR),
        (p + "attn.wkv.weight", (hd, d), LINEAR),
        (p + "attn.kv_norm.weight", (hd,), BF16),
        (p + "attn.wo_a.weight", (g * orank, h * hd // g), LINEAR),
        (p + "attn.wo_b.weight", (d, g * orank), LINEAR),
    ]


def expert_rows(p: str, cfg: DeepseekV4Config | DeepseekV41Config, n_experts: int) -> list[tuple]:
    """The routed experts' rows (w1 / w3 / w2 of each, in expert order), as the checkpoint names them."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return [
        row
        for x in range(n_experts)
        for row in (
            (p + f"ffn.experts.{x}.w1.weight", (i, d), EXPERT),
            (p + f"ffn.experts.{x}.w3.weight", (i, d), EXPERT),
            (p + f"ffn.experts.{x}.w2.weight", (d, i), EXPERT),
        )
    ]


def shared_expert_rows(p: str, cfg: DeepseekV4Config | DeepseekV41Config) -> list[tuple]:
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return [
        (p + "ffn.shared_experts.w1.weight", (i, d), LINEAR),
        (p + "ffn.shared_experts.w3.weight", (i, d), LINEAR),
        (p + "ffn.shared_experts.w2.weight", (d, i), LINEAR),
    ]


def block_specs(cfg: DeepseekV4Config, p: str, kind: str, hash_routed: bool) -> list[TensorSpec]:
    """The tensors of one V4 block under prefix ``p`` (``layers.L.`` or ``mtp.I.``): attention of ``kind``
    (SLIDING / CSA / HCA) with its compressor and indexer, the mHC sites, and the MoE (hash-routed or biased)."""
    d, hd, ql = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    e, k, v = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size
    hi, dh = cfg.index_n_heads, cfg.index_head_dim
    t = core_rows(p, cfg) + [(p + "ffn.gate.weight", (e, d), BF16)] + shared_expert_rows(p, cfg)
    if kind in (CSA, HCA):
        ratio = cfg.compress_rates[kind]
        width = 2 * hd if kind == CSA else hd
        c = p + "attn.compressor."
        t += [
            (c + "wkv.weight", (width, d), BF16),
            (c + "wgate.weight", (width, d), BF16),
            (c + "ape", (ratio, width), FP32),
            (c + "norm.weight", (hd,), BF16),
        ]
    if kind == CSA:
        ratio = cfg.compress_rates[CSA]
        c = p + "attn.indexer."
        t += [
            (c + "wq_b.weight", (hi * dh, ql), LINEAR),
            (c + "weights_proj.weight", (hi, d), BF16),
            (c + "compressor.wkv.weight", (2 * dh, d), BF16),
            (c + "compressor.wgate.weight", (2 * dh, d), BF16),
            (c + "compressor.ape", (ratio, 2 * dh), FP32),
            (c + "compressor.norm.weight", (dh,), BF16),
        ]
    t.append((p + "ffn.gate.tid2eid", (v, k), INT64) if hash_routed else (p + "ffn.gate.bias", (e,), FP32))
    return [TensorSpec(*row) for row in t + expert_rows(p, cfg, e)]


def v4_mtp_inventory(cfg: DeepseekV4Config) -> list[TensorSpec]:
    """The MTP layers ``mtp.I.*`` (I < num_nextn_predict_layers; section A.9): a sliding-window block with a
    biased router, the input projections ``e_proj`` / ``h_proj`` and norms, and its own mHC head and final norm
    (embedding and LM head are the backbone's). None when ``mtp.*`` holds DSpark stages (``v4_dspark_inventory``)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    out = []
    if cfg.dspark is not None:
        return out
    for m in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{m}."
        out += block_specs(cfg, p, SLIDING, hash_routed=False)
        out += [
            TensorSpec(p + "e_proj.weight", (d, d), LINEAR),
            TensorSpec(p + "h_proj.weight", (d, d), LINEAR),
            TensorSpec(p + "enorm.weight", (d,), BF16),
            TensorSpec(p + "hnorm.weight", (d,), BF16),
            TensorSpec(p + "norm.weight", (d,), BF16),
            TensorSpec(p + "hc_head_fn", (n, n * d), FP32),
            TensorSpec(p + "hc_head_base", (n,), FP32),
            TensorSpec(p + "hc_head_scale", (1,), FP32),
        ]
    return out


def v4_dspark_inventory(cfg: DeepseekV4Config, confidence_head: bool = True) -> list[TensorSpec]:
    """V4-Flash-0731's DSpark stages ``mtp.S.*`` (S < ``cfg.dspark.num_stages``), named as vLLM 0.33 loads them:
    each a sliding-window block with a biased router; stage 0 also ``main_proj`` [d, k d] (k tap layers) and
    ``main_norm``; the last stage the head: ``norm``, its mHC head ``hc_head_*``, the Markov factors
    ``markov_head.markov_w1`` / ``markov_w2`` [V, R] and, when the checkpoint has one, ``confidence_head.proj``
    [1, d + R] (fp32 in vLLM; without it drafts carry no confidences)."""
    spec = cfg.dspark
    if spec is None:
        return []
    d, n, v, r = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, spec.markov_rank
    out = []
    for s in range(spec.num_stages):
        p = f"mtp.{s}."
        out += block_specs(cfg, p, SLIDING, hash_routed=False)
        if s == 0:
            out += [
                TensorSpec(p + "main_proj.weight", (d, len(spec.target_layer_ids) * d), LINEAR),
                TensorSpec(p + "main_norm.weight", (d,), BF16),
            ]
        if s == spec.num_stages - 1:
            out += [
                TensorSpec(p + "norm.weight", (d,), BF16),
                TensorSpec(p + "hc_head_fn", (n, n * d), FP32),
                TensorSpec(p + "hc_head_base", (n,), FP32),
                TensorSpec(p + "hc_head_scale", (1,), FP32),
                TensorSpec(p + "markov_head.markov_w1.weight", (v, r), BF16),
                TensorSpec(p + "markov_head.markov_w2.weight", (v, r), BF16),
            ]
            if confidence_head:
                out.append(TensorSpec(p + "confidence_head.proj.weight", (1, d + r), FP32))
    return out


def model_param_for(name: str) -> tuple[str, int | None, slice | None]:
    """Checkpoint name -> (model parameter, expert index or None, row slice kind).

    Routed experts are stacked: w1/w3 fill the two halves of ``ffn.experts.w13[e]``, w2 fills
    ``ffn.experts.w2[e]``. Everything else maps to the parameter of the same name.
    """
    if ".ffn.experts." in name:
        prefix, rest = name.split(".ffn.experts.")
        expert, which, _ = rest.split(".")
        stacked = "w2" if which == "w2" else "w13"
        half = {"w1": 0, "w3": 1}.get(which)
        return f"{prefix}.ffn.experts.{stacked}", int(expert), half
    return name, None, None

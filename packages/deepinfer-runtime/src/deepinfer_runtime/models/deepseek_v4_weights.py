"""The DeepSeek-V4-Flash checkpoint inventory: every tensor's name, shape and storage role.

One table drives the loader (what must be present, how to decode it) and the tiny-checkpoint
writer (what to emit), so the two cannot drift apart. Names are the released checkpoint's
(``layers.L.attn.wq_a.weight``, with ``.scale`` companions for quantised weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_runtime.models.deepseek_v4_config import CSA, HCA, DeepseekV4Config

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
    """All backbone tensors of a V4 checkpoint (the MTP head ``mtp.*`` is listed separately)."""
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    h, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g, orank = cfg.o_groups, cfg.o_lora_rank
    e, i, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    hi, dh = cfg.index_n_heads, cfg.index_head_dim
    mix = (2 + n) * n
    out = [
        TensorSpec("embed.weight", (v, d), BF16),
        TensorSpec("head.weight", (v, d), BF16),
        TensorSpec("norm.weight", (d,), BF16),
        TensorSpec("hc_head_fn", (n, n * d), FP32),
        TensorSpec("hc_head_base", (n,), FP32),
        TensorSpec("hc_head_scale", (1,), FP32),
    ]
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        t = [
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
            (p + "ffn.gate.weight", (e, d), BF16),
            (p + "ffn.shared_experts.w1.weight", (i, d), LINEAR),
            (p + "ffn.shared_experts.w3.weight", (i, d), LINEAR),
            (p + "ffn.shared_experts.w2.weight", (d, i), LINEAR),
        ]
        kind = cfg.layer_types[layer]
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
        t.append(
            (p + "ffn.gate.tid2eid", (v, k), INT64) if cfg.is_hash_layer(layer) else (p + "ffn.gate.bias", (e,), FP32)
        )
        for x in range(e):
            t += [
                (p + f"ffn.experts.{x}.w1.weight", (i, d), EXPERT),
                (p + f"ffn.experts.{x}.w3.weight", (i, d), EXPERT),
                (p + f"ffn.experts.{x}.w2.weight", (d, i), EXPERT),
            ]
        out += [TensorSpec(*row) for row in t]
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

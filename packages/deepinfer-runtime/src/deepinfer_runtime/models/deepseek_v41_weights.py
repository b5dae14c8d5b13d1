"""The DeepSeek-V4.1-Flash checkpoint inventory: every tensor's name, shape and storage role.

Names are the released checkpoint's (``layers.L.attn.wq_a.weight``, ``mtp.S.ffn.gate.bias_vl``, ...). As in
the V4 inventory, one ``TensorSpec`` stands for a quantised weight *and* its ``.scale`` companion;
``stored_tensors`` expands a spec into what the safetensors files hold (so counts can be compared with the
released 96,085 tensors). Differences from V4: no ``hc_head_*``, no hash routing (``tid2eid``), routers carry
``bias`` and ``bias_vl``, compressors only on KV sources (no ``ape``, no ``indexer.compressor``), indexer keys
``indexer.wk`` / ``k_norm`` on KV sources, indexer queries on index sources, Engram tables on Engram layers,
and the DSpark draft stages ``mtp.0..S-1``.
"""

from __future__ import annotations

from deepinfer_runtime.models.deepseek_v4_weights import (
    BF16,
    EXPERT,
    FP32,
    LINEAR,
    TensorSpec,
    core_rows,
    expert_rows,
    shared_expert_rows,
)
from deepinfer_runtime.models.deepseek_v41_config import DeepseekV41Config

# FP8 e4m3 rows [rows, engram_head_dim] + E8M0 scales [rows, engram_head_dim / 32] when quantised
ENGRAM_TABLE = "engram_table"

__all__ = ["ENGRAM_TABLE", "stored_tensors", "checkpoint_tensor_count", "v41_inventory"]


def _block(prefix: str, cfg: DeepseekV41Config, n_experts: int) -> list[TensorSpec]:
    """Tensors every block has (backbone layer or DSpark stage): norms, mHC, attention core, MoE."""
    d, p = cfg.hidden_size, prefix
    gate = [
        (p + "ffn.gate.weight", (n_experts, d), BF16),
        (p + "ffn.gate.bias", (n_experts,), FP32),
        (p + "ffn.gate.bias_vl", (n_experts,), FP32),
    ]
    rows = core_rows(p, cfg) + gate + shared_expert_rows(p, cfg) + expert_rows(p, cfg, n_experts)
    return [TensorSpec(*row) for row in rows]


def _layer_extras(layer: int, cfg: DeepseekV41Config) -> list[TensorSpec]:
    """Compressor / indexer / Engram tensors that only some backbone layers own."""
    d, hd, ql = cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank
    hi, dh = cfg.index_n_heads, cfg.index_head_dim
    p = f"layers.{layer}."
    rows: list[tuple] = []
    if cfg.has_compressor(layer):
        rows.append((p + "attn.compressor.wkv.weight", (hd, d), BF16))
        if cfg.has_gated_compressor(layer):
            rows.append((p + "attn.compressor.wgate.weight", (hd, d), BF16))
        rows += [
            (p + "attn.compressor.norm.weight", (hd,), BF16),
            (p + "attn.indexer.wk.weight", (dh, hd), BF16),
            (p + "attn.indexer.k_norm.weight", (dh,), BF16),
        ]
    if cfg.has_indexer(layer):
        rows += [
            (p + "attn.indexer.wq_b.weight", (hi * dh, ql), LINEAR),
            (p + "attn.indexer.weights_proj.weight", (hi, d), BF16),
        ]
    if cfg.is_engram_layer(layer):
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        rows += [
            (p + "engram.embed.weight", (cfg.engram_rows(layer), cfg.engram_head_dim), ENGRAM_TABLE),
            (p + "engram.wkv.weight", ((cfg.hc_mult + 1) * d, n_cols * cfg.engram_head_dim), LINEAR),
            (p + "engram.q_weight", (cfg.hc_mult, d), BF16),
            (p + "engram.k_weight", (cfg.hc_mult, d), BF16),
        ]
    return [TensorSpec(*row) for row in rows]


def _dspark(cfg: DeepseekV41Config) -> list[TensorSpec]:
    d, v, rank = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
    stages = cfg.num_nextn_predict_layers
    out: list[TensorSpec] = []
    for s in range(stages):
        p = f"mtp.{s}."
        out += _block(p, cfg, cfg.dspark_n_routed_experts)
        if s == 0:
            out += [
                TensorSpec(p + "main_proj.weight", (d, len(cfg.dspark_target_layer_ids) * d), LINEAR),
                TensorSpec(p + "main_norm.weight", (d,), BF16),
            ]
        if s == stages - 1:
            out += [
                TensorSpec(p + "norm.weight", (d,), BF16),
                TensorSpec(p + "markov_head.embed.weight", (v, rank), BF16),
                TensorSpec(p + "markov_head.head.weight", (v, rank), BF16),
                TensorSpec(p + "confidence_head.proj.weight", (1, d + rank), BF16),
            ]
    return out


def _vision(cfg: DeepseekV41Config) -> list[TensorSpec]:
    """Vision tower, aligner and image delimiters (shapes derived from module construction, [V] §10.1)."""
    vc = cfg.vision_config
    if vc is None:
        raise ValueError("v41_inventory(include_vision=True) needs a config with a vision_config")
    w, inter, patch = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    down, d = vc["downsample_ratio"], cfg.hidden_size
    out = [
        TensorSpec("vision.patch_embed.proj.weight", (w, 3 * patch * patch), BF16),
        TensorSpec("vision.patch_embed.proj.bias", (w,), BF16),
    ]
    for b in range(vc["num_hidden_layers"]):
        p = f"vision.blocks.{b}."
        out += [
            TensorSpec(p + "norm1.weight", (w,), BF16),
            TensorSpec(p + "attn.wqkv.weight", (3 * w, w), BF16),
            TensorSpec(p + "attn.wqkv.bias", (3 * w,), BF16),
            TensorSpec(p + "attn.wo.weight", (w, w), BF16),
            TensorSpec(p + "attn.wo.bias", (w,), BF16),
            TensorSpec(p + "norm2.weight", (w,), BF16),
            TensorSpec(p + "mlp.w1.weight", (2 * inter, w), BF16),
            TensorSpec(p + "mlp.w2.weight", (w, inter), BF16),
        ]
    out += [
        TensorSpec("vision.norm.weight", (w,), BF16),
        TensorSpec("aligner.w1.weight", (d, w * down * down), BF16),
        TensorSpec("aligner.w1.bias", (d,), BF16),
        TensorSpec("aligner.w2.weight", (d, d), BF16),
        TensorSpec("aligner.w2.bias", (d,), BF16),
    ]
    # [V] says fp32, [R] says the whole vision part is bf16: UNCONFIRMED, the loader should accept either
    out += [TensorSpec(name, (d,), FP32) for name in ("image_start", "image_end", "image_newline")]
    return out


def v41_inventory(
    cfg: DeepseekV41Config, include_dspark: bool = True, include_vision: bool = False
) -> list[TensorSpec]:
    """All tensors of a V4.1 checkpoint: globals, 40 backbone layers, DSpark stages (and optionally vision).

    A ``LINEAR`` / ``EXPERT`` / ``ENGRAM_TABLE`` spec names the ``.weight``; its ``.scale`` companion is
    implied (see ``stored_tensors``).
    """
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [
        TensorSpec("embed.weight", (v, d), BF16),
        TensorSpec("head.weight", (v, d), BF16),
        TensorSpec("norm.weight", (d,), BF16),
    ]
    for layer in range(cfg.num_hidden_layers):
        out += _block(f"layers.{layer}.", cfg, cfg.n_routed_experts)
        out += _layer_extras(layer, cfg)
    if include_dspark:
        out += _dspark(cfg)
    if include_vision:
        out += _vision(cfg)
    return out


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def stored_tensors(spec: TensorSpec, cfg: DeepseekV41Config) -> list[tuple[str, tuple[int, ...], str]]:
    """What the safetensors files hold for ``spec``: ``(name, shape, safetensors dtype)`` rows.

    Quantised (``cfg.quant`` set): LINEAR -> F8_E4M3 weight + F8_E8M0 block scale; EXPERT (fp4) -> I8 weight
    with two E2M1 codes per byte + F8_E8M0 scale per 32; ENGRAM_TABLE -> F8_E4M3 rows + F8_E8M0 scale per 32.
    Unquantised: those roles are a single BF16 tensor.
    """
    base = spec.name.removesuffix(".weight")
    if spec.role in (LINEAR, EXPERT, ENGRAM_TABLE) and cfg.quant is not None:
        rows, cols = spec.shape
        if spec.role == LINEAR:
            br, bc = cfg.quant.weight_block_size
            return [
                (spec.name, spec.shape, "F8_E4M3"),
                (base + ".scale", (_ceil(rows, br), _ceil(cols, bc)), "F8_E8M0"),
            ]
        if spec.role == EXPERT:
            return [(spec.name, (rows, cols // 2), "I8"), (base + ".scale", (rows, cols // 32), "F8_E8M0")]
        return [(spec.name, spec.shape, "F8_E4M3"), (base + ".scale", (rows, cols // 32), "F8_E8M0")]
    dtype = {FP32: "F32", "int64": "I64"}.get(spec.role, "BF16")
    return [(spec.name, spec.shape, dtype)]


def checkpoint_tensor_count(specs: list[TensorSpec], cfg: DeepseekV41Config) -> int:
    """Number of safetensors tensors ``specs`` expand to (weights plus scale companions)."""
    return sum(len(stored_tensors(s, cfg)) for s in specs)

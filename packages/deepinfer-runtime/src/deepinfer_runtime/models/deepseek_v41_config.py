"""DeepSeek-V4.1-Flash configuration: parsed from a checkpoint's HF ``config.json``.

Reads the released nested layout (root ``architectures`` / ``model_type`` / ``quantization_config`` /
token ids, the language model under ``text_config``, the ViT under ``vision_config``) and also a flat
text config at the root. The vision config is kept as a raw dict (vision is not built yet).

V4.1's attention schedule is source-based: ``compress_ratios[l]`` is the ratio of the compressed cache
layer ``l`` *reads*; only ``kv_source_layer_ids`` own a compressor, only ``index_source_layer_ids`` own
an indexer. Each ratio>0 layer reads compressed KV from the latest KV source at or before it and its
top-k from the latest index source at or before it; both must have the layer's ratio.

Unknown fields and inconsistent values raise ``ConfigError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_kernels import YarnScaling
from deepinfer_kernels.ops.engram import engram_table_primes

from deepinfer_runtime.errors import ConfigError
from deepinfer_runtime.models.config_common import parse_config_file
from deepinfer_runtime.models.config_common import take_field as _take
from deepinfer_runtime.models.deepseek_v4_config import QuantConfig

WINDOW, KV_SOURCE, REUSE, REINDEX = "window", "kv_source", "reuse", "reindex"

# The released quantization_config; DeepInfer refuses any other value of these five keys.
RELEASED_QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# Keys that carry no model semantics for inference (HF bookkeeping, training knobs).
_IGNORED_KEYS = {
    "architectures",
    "transformers_version",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "n_group",
    "topk_group",
    "keys_to_ignore_at_inference",
    "_name_or_path",
    "auto_map",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
}
# Fixed by the architecture: any other value is refused.
_MUST_BE = {
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
}
# Optional keys DeepInfer reads with a default; only the default is supported.
_ONLY_DEFAULT = {"dspark_target_attn_input": True, "use_fp4_sparse_kv": True, "hc_shifted": True}
_ROOT_ONLY = {"architectures", "model_type", "text_config", "vision_config", "quantization_config"}
# Keys that may sit at the root and in text_config alike; both copies must agree.
_SHARED = {"bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings"}

_REQUIRED_INT = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "gate_temp": 1.0,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "candidate_topk_blocks": 0,
    "candidate_block_size": 0,
    "num_nextn_predict_layers": 0,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 0,
    "image_token_id": 129264,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


@dataclass(frozen=True)
class DeepseekV41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    # attention schedule
    compress_ratios: tuple[int, ...]  # backbone layers, then one 0 per DSpark stage
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None  # None: no two-level (candidate-block) filter
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    gate_temp: float
    swiglu_limit: float | None
    # mHC, norms
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_vocab_size: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    # DSpark
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    # tokens
    image_token_id: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    quant: QuantConfig | None = None
    vision_config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # --- derived schedule ---
    def compress_ratio(self, layer: int) -> int:
        """Ratio of the compressed cache ``layer`` reads (0: window only); DSpark stages are n..n+S-1."""
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def layer_role(self, layer: int) -> str:
        """``window`` (ratio 0), ``kv_source`` (owns a compressor), ``reindex`` (own indexer queries
        against its KV source's keys) or ``reuse`` (reads both KV and top-k from its sources)."""
        self._check_backbone(layer)
        if self.compress_ratios[layer] == 0:
            return WINDOW
        if layer in self.kv_source_layer_ids:
            return KV_SOURCE
        if layer in self.index_source_layer_ids:
            return REINDEX
        return REUSE

    def kv_source_of(self, layer: int) -> int | None:
        """The layer whose compressed KV (and index keys) ``layer`` reads; None for window layers."""
        self._check_backbone(layer)
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source_of(self, layer: int) -> int | None:
        """The layer whose top-k selection ``layer`` uses; None for window layers."""
        self._check_backbone(layer)
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def has_compressor(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and layer in self.kv_source_layer_ids

    def has_gated_compressor(self, layer: int) -> bool:
        """Ratio-2 KV sources have ``compressor.wgate``; ratio-1 sources do not."""
        return self.has_compressor(layer) and self.compress_ratios[layer] > 1

    def has_indexer(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and layer in self.index_source_layer_ids

    def is_engram_layer(self, layer: int) -> bool:
        return layer in self.engram_layer_ids

    def engram_rows(self, layer: int) -> int:
        return self.engram_num_embeddings[self.engram_layer_ids.index(layer)]

    @property
    def n_prefill_layer(self) -> int:
        """YOCO boundary: the first ratio-1 layer (num_hidden_layers if there is none)."""
        ones = [i for i in range(self.num_hidden_layers) if self.compress_ratios[i] == 1]
        return ones[0] if ones else self.num_hidden_layers

    @property
    def engram_primes(self) -> list[list[int]]:
        """Per Engram layer, its ``(max_ngram - 1) * n_heads`` bucket primes (spec B.6.1 step 6)."""
        return engram_table_primes(
            self.engram_vocab_size,
            len(self.engram_layer_ids),
            self.engram_max_ngram_size - 1,
            self.engram_n_heads,
        )

    def _check_backbone(self, layer: int) -> None:
        if not 0 <= layer < self.num_hidden_layers:
            raise IndexError(f"layer {layer} is not a backbone layer (0..{self.num_hidden_layers - 1})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41Config:
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Config:
        return parse_config_file(path, _parse)


def _int_list(raw: dict, key: str, default: Any = ...) -> tuple[int, ...]:
    value = _take(raw, key, list, default)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"field {key!r} = {value!r} must be a list of ints")
    return tuple(value)


def _merge_layout(raw: dict[str, Any]) -> tuple[dict[str, Any], dict | None, dict | None]:
    """Split the nested (or flat) layout into (text fields, quantization_config, vision_config)."""
    raw = dict(raw)
    model_type = raw.pop("model_type", None)
    if "text_config" in raw:
        if model_type not in (None, "deepseek_v41"):
            raise ConfigError(f"field 'model_type' = {model_type!r}: this parser reads 'deepseek_v41'")
        text = _take(raw, "text_config", dict)
        text = dict(text)
        text_type = text.pop("model_type", "deepseek_v41_text")
        if text_type != "deepseek_v41_text":
            raise ConfigError(f"field 'text_config.model_type' = {text_type!r}: expected 'deepseek_v41_text'")
        for key in _ROOT_ONLY & set(text):
            raise ConfigError(f"field 'text_config.{key}' belongs at the config root")
    else:  # flat: the text config itself at the root
        if model_type not in (None, "deepseek_v41", "deepseek_v41_text"):
            raise ConfigError(f"field 'model_type' = {model_type!r}: this parser reads 'deepseek_v41'")
        text = {}
    arch = raw.get("architectures")
    if arch is not None and arch != ["DeepseekV41ForCausalLM"]:
        raise ConfigError(f"field 'architectures' = {arch!r}: expected ['DeepseekV41ForCausalLM']")
    quant = raw.pop("quantization_config", None)
    vision = raw.pop("vision_config", None)
    if vision is not None and not isinstance(vision, dict):
        raise ConfigError("field 'vision_config' must be an object")
    for key, value in raw.items():
        if key in text and text[key] != value:
            raise ConfigError(f"field {key!r}: root value {value!r} disagrees with text_config's {text[key]!r}")
        text[key] = value
    return text, quant, vision


def _parse_quant(qc: Any) -> QuantConfig | None:
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("field 'quantization_config' must be an object")
    for key in qc:
        if key not in RELEASED_QUANT:
            raise ConfigError(f"unknown field 'quantization_config.{key}'")
    for key, want in RELEASED_QUANT.items():
        if key not in qc:
            raise ConfigError(f"missing field 'quantization_config.{key}' (released value {want!r})")
        if qc[key] != want:
            raise ConfigError(f"field 'quantization_config.{key}' = {qc[key]!r}: DeepSeek V4.1 supports only {want!r}")
    return QuantConfig(tuple(qc["weight_block_size"]), qc["scale_fmt"], qc["expert_dtype"])


def _parse_yarn(yarn_raw: Any) -> YarnScaling | None:
    if not yarn_raw:
        return None
    if not isinstance(yarn_raw, dict):
        raise ConfigError("field 'rope_scaling' must be an object")
    kind = yarn_raw.get("rope_type", yarn_raw.get("type"))
    if kind != "yarn":
        raise ConfigError(f"field 'rope_scaling': type {kind!r} unsupported (DeepSeek V4.1 uses 'yarn')")
    if yarn_raw.get("mscale") or yarn_raw.get("mscale_all_dim"):
        raise ConfigError("field 'rope_scaling': mscale is not used by DeepSeek V4.1")
    try:
        return YarnScaling(
            factor=float(yarn_raw["factor"]),
            original_max_position_embeddings=int(yarn_raw["original_max_position_embeddings"]),
            beta_fast=float(yarn_raw.get("beta_fast") or 32),
            beta_slow=float(yarn_raw.get("beta_slow") or 1),
        )
    except KeyError as exc:
        raise ConfigError(f"field 'rope_scaling' lacks {exc}") from None


def _parse(raw_in: dict[str, Any]) -> DeepseekV41Config:
    if not isinstance(raw_in, dict):
        raise ConfigError("config must be a JSON object")
    raw, qc, vision = _merge_layout(raw_in)
    quant = _parse_quant(qc)

    for key, want in _MUST_BE.items():
        if key in raw and raw.pop(key) != want:
            raise ConfigError(f"field {key!r}: only {want!r} is supported by DeepSeek V4.1")
    for key, want in _ONLY_DEFAULT.items():
        if key in raw and raw.pop(key) != want:
            raise ConfigError(f"field {key!r}: only {want!r} is supported")
    if "num_hash_layers" in raw:
        raise ConfigError("field 'num_hash_layers': DeepSeek V4.1 has no hash-routed layers")

    d: dict[str, Any] = {k: _take(raw, k, int) for k in _REQUIRED_INT}
    for key, default in _DEFAULTS.items():
        if key == "eos_token_id":
            d[key] = raw.pop(key, default)
        elif key in ("bos_token_id", "pad_token_id"):
            d[key] = _take(raw, key, (int, type(None)), default)
        else:
            typ = float if isinstance(default, float) else type(default)
            d[key] = _take(raw, key, typ, default)
    n = d["num_hidden_layers"]

    # --- attention schedule ---
    ratios = _int_list(raw, "compress_ratios")
    kv_sources = _int_list(raw, "kv_source_layer_ids", ())
    index_sources = _int_list(raw, "index_source_layer_ids", ())
    index_k = raw.pop("index_k_source_layer_ids", None)
    if index_k is not None and tuple(index_k) != kv_sources:
        raise ConfigError("field 'index_k_source_layer_ids': only the default (= kv_source_layer_ids) is supported")
    cand = _take(raw, "candidate_source_layer_id", int, -1)
    d["candidate_source_layer_id"] = None if cand < 0 else cand

    yarn = _parse_yarn(raw.pop("rope_scaling", None))
    d["yarn"] = yarn

    # --- Engram ---
    d["engram_layer_ids"] = _int_list(raw, "engram_layer_ids", ())
    has_engram = bool(d["engram_layer_ids"])
    d["engram_num_embeddings"] = _int_list(raw, "engram_num_embeddings", ... if has_engram else ())
    for key in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size"):
        d[key] = _take(raw, key, int, ... if has_engram else 0)
    d["engram_compressed_vocab_size"] = _take(raw, "engram_compressed_vocab_size", int, 99092)
    pad = _take(raw, "engram_pad_token_id", int, None)
    alias = _take(raw, "engram_pad_id", int, None)
    if pad is not None and alias is not None and pad != alias:
        raise ConfigError(f"field 'engram_pad_id' = {alias} disagrees with 'engram_pad_token_id' = {pad}")
    d["engram_pad_token_id"] = pad if pad is not None else (alias if alias is not None else 2)

    # --- DSpark ---
    d["dspark_target_layer_ids"] = _int_list(raw, "dspark_target_layer_ids", ())
    d["dspark_n_routed_experts"] = _take(raw, "dspark_n_routed_experts", int, 0) or d["n_routed_experts"]
    d["dspark_num_experts_per_tok"] = _take(raw, "dspark_num_experts_per_tok", int, 0) or d["num_experts_per_tok"]

    extra = {k: raw.pop(k) for k in list(raw) if k in _IGNORED_KEYS}
    if raw:
        raise ConfigError(f"unknown config field(s): {sorted(raw)}")

    # compress_ratios: n backbone entries, optionally followed by one 0 per DSpark stage
    n_mtp = d["num_nextn_predict_layers"]
    if len(ratios) not in (n, n + n_mtp):
        raise ConfigError(
            f"field 'compress_ratios' has {len(ratios)} entries; expected num_hidden_layers = {n} "
            f"(+ num_nextn_predict_layers = {n_mtp})"
        )
    bad = sorted({r for r in ratios if r not in (0, 1, 2)})
    if bad:
        raise ConfigError(f"field 'compress_ratios': values {bad} not in (0, 1, 2)")
    if any(ratios[n:]):
        raise ConfigError("field 'compress_ratios': DSpark stages (entries past num_hidden_layers) must be 0")
    ratios = ratios[:n] + (0,) * n_mtp

    cfg = DeepseekV41Config(
        **d,
        compress_ratios=ratios,
        kv_source_layer_ids=kv_sources,
        index_source_layer_ids=index_sources,
        quant=quant,
        vision_config=vision,
        extra=extra,
    )
    _check(cfg)
    return cfg


def _check(c: DeepseekV41Config) -> None:
    def bad(msg: str) -> None:
        raise ConfigError(msg)

    n, r = c.num_hidden_layers, c.compress_ratios

    # --- sources ---
    for name, ids in (
        ("kv_source_layer_ids", c.kv_source_layer_ids),
        ("index_source_layer_ids", c.index_source_layer_ids),
    ):
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
            bad(f"field {name!r} = {list(ids)} must be increasing backbone layer ids in [0, {n})")
        for i in ids:
            if r[i] == 0:
                bad(f"field {name!r}: layer {i} has compress ratio 0 and cannot be a source")
    missing = sorted(set(c.kv_source_layer_ids) - set(c.index_source_layer_ids))
    if missing:
        bad(f"field 'index_source_layer_ids' must include every KV source; missing {missing}")
    for layer in range(n):
        if r[layer] == 0:
            continue
        for name, ids in (
            ("kv_source_layer_ids", c.kv_source_layer_ids),
            ("index_source_layer_ids", c.index_source_layer_ids),
        ):
            before = [s for s in ids if s <= layer]
            if not before:
                bad(f"field {name!r}: layer {layer} (ratio {r[layer]}) has no source at or before it")
            if r[before[-1]] != r[layer]:
                bad(
                    f"field {name!r}: layer {layer} (ratio {r[layer]}) would read source {before[-1]} "
                    f"of ratio {r[before[-1]]}"
                )
    cand = c.candidate_source_layer_id
    if cand is not None:
        if cand not in c.kv_source_layer_ids or r[cand] != 1:
            bad(f"field 'candidate_source_layer_id' = {cand} must be a ratio-1 KV source")
        if c.candidate_topk_blocks < 1 or c.candidate_block_size < 1:
            bad("fields 'candidate_topk_blocks' / 'candidate_block_size' must be positive with a candidate source")

    # --- attention / MoE shapes ---
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        bad(f"field 'qk_rope_head_dim' = {c.qk_rope_head_dim} must be even and <= head_dim = {c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        bad(f"field 'o_groups' = {c.o_groups} must divide num_attention_heads = {c.num_attention_heads}")
    if c.sliding_window < 1:
        bad(f"field 'sliding_window' = {c.sliding_window} must be positive")
    if c.index_topk < 1:
        bad(f"field 'index_topk' = {c.index_topk} must be positive")
    if c.n_shared_experts != 1:
        bad(f"field 'n_shared_experts' = {c.n_shared_experts}: DeepSeek V4.1 has exactly 1")
    if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
        bad(f"field 'num_experts_per_tok' = {c.num_experts_per_tok} must be in [1, n_routed_experts]")
    if c.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad(f"field 'scoring_func' = {c.scoring_func!r} must be sqrtsoftplus, sigmoid or softmax")
    if c.gate_temp <= 0:
        bad(f"field 'gate_temp' = {c.gate_temp} must be positive")
    if c.quant is not None and c.moe_intermediate_size % 32:
        bad("field 'moe_intermediate_size' must be a multiple of 32 for fp4 experts")

    # --- Engram ---
    if c.engram_layer_ids:
        ids = c.engram_layer_ids
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < c.n_prefill_layer for i in ids):
            bad(f"field 'engram_layer_ids' = {list(ids)} must be increasing encoder layers (< {c.n_prefill_layer})")
        if c.engram_max_ngram_size < 2 or c.engram_n_heads < 1 or c.engram_vocab_size < 2:
            bad("fields 'engram_max_ngram_size' (>= 2), 'engram_n_heads', 'engram_vocab_size' must be positive")
        if c.engram_head_dim < 32 or c.engram_head_dim % 32:
            bad(f"field 'engram_head_dim' = {c.engram_head_dim} must be a positive multiple of 32")
        want = tuple(sum(p) for p in c.engram_primes)
        if c.engram_num_embeddings != want:
            bad(
                f"field 'engram_num_embeddings' = {list(c.engram_num_embeddings)} must equal the per-layer "
                f"prime sums {list(want)} (engram_vocab_size = {c.engram_vocab_size})"
            )

    # --- DSpark ---
    if c.num_nextn_predict_layers < 0:
        bad(f"field 'num_nextn_predict_layers' = {c.num_nextn_predict_layers} must be >= 0")
    if c.num_nextn_predict_layers:
        if c.dspark_block_size < 1:
            bad(f"field 'dspark_block_size' = {c.dspark_block_size} must be positive")
        taps = c.dspark_target_layer_ids
        if not taps or any(not c.n_prefill_layer <= t < n for t in taps):
            bad(f"field 'dspark_target_layer_ids' = {list(taps)} must be decoder layers in [{c.n_prefill_layer}, {n})")
        if c.dspark_markov_rank < 1:
            bad(f"field 'dspark_markov_rank' = {c.dspark_markov_rank} must be positive")
        if not 0 <= c.dspark_noise_token_id < c.vocab_size:
            bad(f"field 'dspark_noise_token_id' = {c.dspark_noise_token_id} must be a token id")
        if not 0 < c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts:
            bad(f"field 'dspark_num_experts_per_tok' = {c.dspark_num_experts_per_tok} must be in [1, experts]")

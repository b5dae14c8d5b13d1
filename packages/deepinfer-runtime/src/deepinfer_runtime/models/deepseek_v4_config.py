"""DeepSeek-V4-Flash configuration: parsed from a checkpoint's HF ``config.json``.

Accepts the released DeepSeek spelling (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``, top-level ``expert_dtype``) and the spelling transformers
writes after loading (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
``rope_parameters``, ``partial_rotary_factor``). Unknown fields and inconsistent values raise
``ConfigError`` naming the field: a checkpoint we do not understand must not load silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_kernels import YarnScaling

from deepinfer_runtime.errors import ConfigError
from deepinfer_runtime.models.config_common import parse_config_file
from deepinfer_runtime.models.config_common import take_field as _take

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Keys that carry no model semantics for inference (HF bookkeeping, training knobs).
_IGNORED_KEYS = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "initializer_range",
    "use_cache",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_jitter_noise",
    "pad_token_id",
    "topk_method",
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
    "first_k_dense_replace",
}
_MUST_BE = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "num_key_value_heads": 1}
_FIELDS_WITH_DEFAULTS = {
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "n_shared_experts": 1,
    "sliding_window": 128,
    "o_groups": 8,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)
_LEGACY = {
    "compress_ratios",
    "compress_rate_csa",
    "compress_rate_hca",
    "num_hash_layers",
    "qk_rope_head_dim",
    "rope_scaling",
    "expert_dtype",
}
_HF_NATIVE = {"layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"}


@dataclass(frozen=True)
class QuantConfig:
    """How linear weights are stored: FP8 e4m3 with per-block scales; experts FP4, FP8 or bf16."""

    weight_block_size: tuple[int, int]
    scale_fmt: str  # "ue8m0" (E8M0 power-of-two scales) or "float"
    expert_dtype: str  # "fp4" (MXFP4, one E8M0 scale per 32), "fp8" or "bf16"


@dataclass(frozen=True)
class DSparkSpec:
    """V4-Flash-0731's DSpark draft head (``mtp.0 .. mtp.{num_stages - 1}``; absent: ``DeepseekV4Config.dspark``
    is None). Keys as vLLM 0.33 reads them (``vllm/models/deepseek_v4/nvidia/dspark.py``, ``config/speculative.py``).

    target_layer_ids: backbone layers whose entering streams (mean over the hc streams) feed ``main_proj``.
    num_stages: the draft's sliding-window blocks (``n_mtp_layers``; vLLM's default 3).
    block_size: N drafts per block (γ); noise_token_id: the token of the N - 1 non-anchor block rows.
    markov_rank: R of the Markov head (``markov_w1`` [V, R], ``markov_w2`` [V, R]).
    """

    target_layer_ids: tuple[int, ...]
    num_stages: int
    block_size: int
    noise_token_id: int
    markov_rank: int


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    hash_layers: int
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    quant: QuantConfig | None = None
    dspark: DSparkSpec | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-window-only layers, else the layer's compression ratio."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.hash_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        return _parse(dict(raw))

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        return parse_config_file(path, _parse)


def _parse(raw: dict[str, Any]) -> DeepseekV4Config:
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"field 'model_type' = {model_type!r}: this parser reads 'deepseek_v4'")
    for key, want in _MUST_BE.items():
        if key in raw and raw.pop(key) != want:
            raise ConfigError(f"field {key!r}: only {want!r} is supported by DeepSeek V4")
    ints = {k: _take(raw, k, int) for k in _REQUIRED}
    d = {
        k: _take(raw, k, type(v) if not isinstance(v, float) else float, v)
        for k, v in _FIELDS_WITH_DEFAULTS.items()
        if k not in ("bos_token_id", "eos_token_id")
    }
    bos = raw.pop("bos_token_id", 0)
    eos = raw.pop("eos_token_id", 1)
    n = ints["num_hidden_layers"]

    # --- layer schedule: legacy per-layer ratios, or HF's layer_types + compress_rates ---
    rates = {CSA: 4, HCA: 128}
    if "compress_rates" in raw:
        rates.update(_take(raw, "compress_rates", dict))
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if legacy in raw:
            rates[kind] = _take(raw, legacy, int)
    ratios = raw.pop("compress_ratios", None)
    extra_ratios: list[int] = []
    layer_types = raw.pop("layer_types", None)
    if layer_types is None:
        if ratios is None:
            raise ConfigError("need 'compress_ratios' (or 'layer_types') to know each layer's attention kind")
        if not isinstance(ratios, list) or len(ratios) < n:
            raise ConfigError(f"field 'compress_ratios' must list at least num_hidden_layers={n} ratios")
        by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
        bad = [r for r in ratios if r not in by_ratio]
        if bad:
            raise ConfigError(f"field 'compress_ratios': values {sorted(set(bad))} not in (0, 4, 128)")
        layer_types = [by_ratio[r] for r in ratios[:n]]
        extra_ratios = ratios[n:]  # the MTP / DSpark layers' (all sliding-window in the releases)
    if len(layer_types) < n or any(t not in (SLIDING, CSA, HCA) for t in layer_types):
        raise ConfigError(f"field 'layer_types' must give one of {(SLIDING, CSA, HCA)} for each of {n} layers")
    layer_types = tuple(layer_types[:n])

    mlp_types = raw.pop("mlp_layer_types", None)
    n_hash = raw.pop("num_hash_layers", None)
    if mlp_types is not None:
        n_hash_from_types = sum(1 for t in mlp_types if t == "hash_moe")
        if list(mlp_types[:n_hash_from_types]) != ["hash_moe"] * n_hash_from_types:
            raise ConfigError("field 'mlp_layer_types': hash_moe layers must come first")
        n_hash = n_hash_from_types
    n_hash = 0 if n_hash is None else n_hash
    if not isinstance(n_hash, int) or not 0 <= n_hash <= n:
        raise ConfigError(f"field 'num_hash_layers' = {n_hash!r} must be an int in [0, {n}]")

    # --- rope ---
    rope_dim = raw.pop("qk_rope_head_dim", None)
    prf = raw.pop("partial_rotary_factor", None)
    if rope_dim is None:
        rope_dim = int(ints["head_dim"] * prf) if prf is not None else 64
    yarn_raw = raw.pop("rope_scaling", None)
    rope_params = raw.pop("rope_parameters", None)
    if yarn_raw is None and isinstance(rope_params, dict):
        compress = rope_params.get("compress", rope_params)
        if compress.get("rope_type", compress.get("type")) == "yarn":
            yarn_raw = compress
    yarn = None
    if yarn_raw:
        kind = yarn_raw.get("rope_type", yarn_raw.get("type"))
        if kind != "yarn":
            raise ConfigError(f"field 'rope_scaling': type {kind!r} unsupported (DeepSeek V4 uses 'yarn')")
        try:
            yarn = YarnScaling(
                factor=float(yarn_raw["factor"]),
                original_max_position_embeddings=int(yarn_raw["original_max_position_embeddings"]),
                beta_fast=float(yarn_raw.get("beta_fast") or 32),
                beta_slow=float(yarn_raw.get("beta_slow") or 1),
            )
        except KeyError as exc:
            raise ConfigError(f"field 'rope_scaling' lacks {exc}") from None

    # --- quantization ---
    expert_dtype = raw.pop("expert_dtype", None)
    qc = raw.pop("quantization_config", None)
    quant = None
    if qc is not None:
        if qc.get("quant_method", "fp8") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"field 'quantization_config' = {qc}: only fp8 e4m3 block quantization is supported")
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"field 'quantization_config.weight_block_size' = {block!r} must be [int, int]")
        scale_fmt = qc.get("scale_fmt") or "float"
        if scale_fmt not in ("ue8m0", "float"):
            raise ConfigError(f"field 'quantization_config.scale_fmt' = {scale_fmt!r} must be 'ue8m0' or absent")
        expert_dtype = qc.get("expert_dtype", expert_dtype) or "fp8"
        quant = QuantConfig(tuple(block), scale_fmt, expert_dtype)
    elif expert_dtype not in (None, "bf16"):
        raise ConfigError(f"field 'expert_dtype' = {expert_dtype!r} without a 'quantization_config'")
    if quant is not None and quant.expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(f"field 'expert_dtype' = {quant.expert_dtype!r} must be fp4, fp8 or bf16")

    dspark = _parse_dspark(raw, n, ints, extra_ratios)
    extra = {k: raw.pop(k) for k in list(raw) if k in _IGNORED_KEYS}
    if raw:
        raise ConfigError(f"unknown config field(s): {sorted(raw)}")

    cfg = DeepseekV4Config(
        **ints,
        **{
            k: d[k]
            for k in (
                "o_groups",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "sliding_window",
                "rope_theta",
                "compress_rope_theta",
                "max_position_embeddings",
                "scoring_func",
                "norm_topk_prob",
                "routed_scaling_factor",
                "swiglu_limit",
                "hc_mult",
                "hc_sinkhorn_iters",
                "hc_eps",
                "rms_norm_eps",
                "num_nextn_predict_layers",
            )
        },
        qk_rope_head_dim=rope_dim,
        layer_types=layer_types,
        compress_rates=rates,
        hash_layers=n_hash,
        yarn=yarn,
        bos_token_id=bos,
        eos_token_id=eos,
        quant=quant,
        dspark=dspark,
        extra=extra,
    )
    if d["n_shared_experts"] != 1:
        raise ConfigError(f"field 'n_shared_experts' = {d['n_shared_experts']}: DeepSeek V4 has exactly 1")
    if d["tie_word_embeddings"]:
        raise ConfigError("field 'tie_word_embeddings' = true: DeepSeek V4 has an untied head")
    _check(cfg)
    return cfg


def _parse_dspark(raw: dict[str, Any], n: int, ints: dict[str, int], extra_ratios: list[int]) -> DSparkSpec | None:
    """The DSpark fields of a V4-Flash-0731 config (None without ``dspark_target_layer_ids``)."""
    taps = raw.pop("dspark_target_layer_ids", None)
    stages = raw.pop("n_mtp_layers", None)
    block = _take(raw, "dspark_block_size", int, 5)
    noise = _take(raw, "dspark_noise_token_id", int, 128799)
    rank = _take(raw, "dspark_markov_rank", int, 0)
    for key, backbone in (("dspark_n_routed_experts", "n_routed_experts"), ("dspark_num_experts_per_tok", None)):
        value = raw.pop(key, None)
        want = ints["n_routed_experts"] if backbone else ints["num_experts_per_tok"]
        if value not in (None, 0, want):
            raise ConfigError(
                f"field {key!r} = {value!r}: V4 DSpark stages are built with the backbone's MoE ({want}), as in "
                "vLLM 0.33; other sizes are V4.1's"
            )
    if not taps:
        return None
    # tap L = the streams after layer L - 1 (vLLM: ``idx + 1 in aux_hidden_state_layers``), so 1 <= L <= n
    if not (
        isinstance(taps, list) and all(isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= n for t in taps)
    ):
        raise ConfigError(f"field 'dspark_target_layer_ids' = {taps!r} must list layers in [1, {n}]")
    stages = 3 if stages is None else stages
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"field 'n_mtp_layers' = {stages!r} must be a positive int")
    if any(r != 0 for r in extra_ratios[:stages]):
        raise ConfigError(
            f"field 'compress_ratios': the DSpark stages' ratios {extra_ratios[:stages]} must be 0 (sliding-window "
            "only, as in V4-Flash-0731)"
        )
    if block < 1:
        raise ConfigError(f"field 'dspark_block_size' = {block} must be positive")
    if rank < 1:
        raise ConfigError(f"field 'dspark_markov_rank' = {rank} must be positive with a DSpark head")
    if not 0 <= noise < ints["vocab_size"]:
        raise ConfigError(f"field 'dspark_noise_token_id' = {noise} must be a token id")
    return DSparkSpec(tuple(taps), stages, block, noise, rank)


def _check(c: DeepseekV4Config) -> None:
    def bad(msg: str) -> None:
        raise ConfigError(msg)

    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.head_dim:
        bad(f"field 'qk_rope_head_dim' = {c.qk_rope_head_dim} must be even and <= head_dim = {c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        bad(f"field 'o_groups' = {c.o_groups} must divide num_attention_heads = {c.num_attention_heads}")
    if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
        bad(f"field 'num_experts_per_tok' = {c.num_experts_per_tok} must be in [1, n_routed_experts]")
    if c.sliding_window < 1:
        bad(f"field 'sliding_window' = {c.sliding_window} must be positive")
    if c.index_head_dim < c.qk_rope_head_dim or c.index_head_dim % 2:
        bad(f"field 'index_head_dim' = {c.index_head_dim} must be even and >= qk_rope_head_dim")
    if c.compress_rates.get(CSA, 4) < 1 or c.compress_rates.get(HCA, 128) < 1:
        bad(f"field 'compress_rates' = {c.compress_rates} must be positive")
    if c.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad(f"field 'scoring_func' = {c.scoring_func!r} must be sqrtsoftplus, sigmoid or softmax")
    if c.quant is not None and c.quant.expert_dtype == "fp4" and c.moe_intermediate_size % 32:
        bad("field 'moe_intermediate_size' must be a multiple of 32 for fp4 experts")

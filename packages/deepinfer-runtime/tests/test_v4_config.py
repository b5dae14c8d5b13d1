"""config.json parsing: the released spelling, transformers' spelling, and clear errors."""

import json

import pytest
from deepinfer_runtime import ConfigError
from deepinfer_runtime.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config
from deepinfer_runtime.testing.tiny_checkpoint import tiny_v4_config

RELEASED_V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_released_config_parses_to_the_released_schedule():
    cfg = DeepseekV4Config.from_dict(RELEASED_V4_FLASH)
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and cfg.layer_types[-1] == CSA
    assert sum(t == CSA for t in cfg.layer_types) == 21 and sum(t == HCA for t in cfg.layer_types) == 20
    assert cfg.hash_layers == 3 and cfg.is_hash_layer(2) and not cfg.is_hash_layer(3)
    assert cfg.quant.weight_block_size == (128, 128) and cfg.quant.expert_dtype == "fp4"
    assert cfg.yarn.factor == 16 and cfg.compress_ratio(3) == 128 and cfg.compress_ratio(0) == 0


def test_transformers_spelling_is_equivalent():
    from transformers import DeepseekV4Config as HFConfig

    hf = HFConfig(**{k: v for k, v in RELEASED_V4_FLASH.items() if k not in ("quantization_config", "expert_dtype")})
    saved = hf.to_dict()
    ours = DeepseekV4Config.from_dict(saved)
    ref = DeepseekV4Config.from_dict(RELEASED_V4_FLASH)
    assert ours.layer_types == ref.layer_types and ours.hash_layers == ref.hash_layers
    assert ours.qk_rope_head_dim == 64 and ours.yarn == ref.yarn


@pytest.mark.parametrize(
    "change, field",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"compress_ratios": [0, 5, 4, 4]}, "compress_ratios"),
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"o_groups": 3}, "o_groups"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
        ({"num_hash_layers": 9}, "num_hash_layers"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ],
)
def test_bad_fields_are_named(change, field):
    raw = tiny_v4_config(**change)
    with pytest.raises(ConfigError, match=field):
        DeepseekV4Config.from_dict(raw)


def test_missing_required_field_and_bad_json(tmp_path):
    raw = tiny_v4_config()
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        DeepseekV4Config.from_dict(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DeepseekV4Config.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(tiny_v4_config()))
    assert DeepseekV4Config.from_file(tmp_path / "config.json").hidden_size == 64

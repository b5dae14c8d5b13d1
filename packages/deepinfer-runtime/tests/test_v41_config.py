"""DeepSeek-V4.1 config.json parsing, derived layer roles, clear errors, and the tensor inventory."""

import copy
import dataclasses
import json

import pytest
from deepinfer_runtime import ConfigError
from deepinfer_runtime.models.deepseek_v41_config import KV_SOURCE, REINDEX, REUSE, WINDOW, DeepseekV41Config
from deepinfer_runtime.models.deepseek_v41_weights import (
    ENGRAM_TABLE,
    checkpoint_tensor_count,
    stored_tensors,
    v41_inventory,
)

RELEASED_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "compress_rope_theta": 160000,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
RELEASED_QUANT = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
RELEASED_VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}
RELEASED = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "transformers_version": "5.0.0",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": RELEASED_QUANT,
    "text_config": RELEASED_TEXT,
    "vision_config": RELEASED_VISION,
}

# decisions doc §6
TINY_TEXT = {
    "vocab_size": 129280, "hidden_size": 128, "num_hidden_layers": 12,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 32,
    "q_lora_rank": 64, "o_groups": 4, "o_lora_rank": 32,
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
    "rms_norm_eps": 1e-20, "swiglu_limit": 10.0, "tie_word_embeddings": False, "initializer_range": 0.1,
    "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6], "index_source_layer_ids": [2, 4, 6, 8, 10],
    "candidate_source_layer_id": 6, "candidate_topk_blocks": 4, "candidate_block_size": 4,
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 8,
    "n_routed_experts": 16, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4], "engram_num_embeddings": [3828, 7078], "engram_max_ngram_size": 4,
    "engram_vocab_size": 100, "engram_n_heads": 8, "engram_head_dim": 64,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [9, 10, 11], "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 3,
}  # fmt: skip


def _released(**text_overrides):
    raw = copy.deepcopy(RELEASED)
    raw["text_config"].update(text_overrides)
    return raw


def test_released_config_parses():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.index_n_heads) == (5120, 40, 384, 32)
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.quant is not None and cfg.quant.weight_block_size == (32, 32) and cfg.quant.expert_dtype == "fp4"
    assert cfg.gate_temp == 1.0 and cfg.rms_norm_eps == 1e-20
    assert cfg.engram_num_embeddings == (384006168, 384016682) and cfg.engram_pad_token_id == 2
    assert cfg.vision_config["num_hidden_layers"] == 32
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.image_token_id) == (0, 1, 2, 129264)
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratio(41) == 0
    assert cfg.candidate_source_layer_id == 20 and cfg.n_prefill_layer == 20


def test_flat_text_config_parses(tmp_path):
    flat = {**RELEASED_TEXT, "quantization_config": RELEASED_QUANT}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(flat))
    flat_cfg = DeepseekV41Config.from_file(path)
    nested = DeepseekV41Config.from_dict({k: v for k, v in RELEASED.items() if k != "vision_config"})
    assert dataclasses.replace(flat_cfg, extra={}) == dataclasses.replace(nested, extra={})


def test_released_roles_match_spec_b31():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    want = {0: (WINDOW, None, None), 1: (WINDOW, None, None)}
    for src in (2, 8, 14):
        want[src] = (KV_SOURCE, src, src)
        for layer in range(src + 1, src + 6):
            want[layer] = (REUSE, src, src)
    want[20] = (KV_SOURCE, 20, 20)
    for layer in (21, 22, 23):
        want[layer] = (REUSE, 20, 20)
    for src in (24, 28, 32, 36):
        want[src] = (REINDEX, 20, src)
        for layer in range(src + 1, src + 4):
            want[layer] = (REUSE, 20, src)
    got = {layer: (cfg.layer_role(layer), cfg.kv_source_of(layer), cfg.index_source_of(layer)) for layer in range(40)}
    assert got == want
    assert [layer for layer in range(40) if cfg.has_gated_compressor(layer)] == [2, 8, 14]
    assert [layer for layer in range(40) if cfg.is_engram_layer(layer)] == [1, 14]
    assert [sum(p) for p in cfg.engram_primes] == [384006168, 384016682]


def test_tiny_config_roles():
    cfg = DeepseekV41Config.from_dict(
        {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
         "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
         "quantization_config": RELEASED_QUANT, "text_config": TINY_TEXT}
    )  # fmt: skip
    roles = [cfg.layer_role(layer) for layer in range(12)]
    assert roles == [
        WINDOW,
        WINDOW,
        KV_SOURCE,
        REUSE,
        KV_SOURCE,
        REUSE,
        KV_SOURCE,
        REUSE,
        REINDEX,
        REUSE,
        REINDEX,
        REUSE,
    ]
    assert [cfg.kv_source_of(layer) for layer in range(2, 12)] == [2, 2, 4, 4, 6, 6, 6, 6, 6, 6]
    assert [cfg.index_source_of(layer) for layer in range(6, 12)] == [6, 6, 8, 8, 10, 10]
    assert cfg.n_prefill_layer == 6 and cfg.candidate_source_layer_id == 6
    assert cfg.engram_layer_ids == (1, 4) and [sum(p) for p in cfg.engram_primes] == [3828, 7078]
    assert cfg.engram_primes[0][0] == 101 and cfg.engram_primes[1][-1] == 367


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"bogus_field": 1}, "bogus_field"),
        ({"compress_ratios": [0, 0, 3] + [2] * 17 + [1] * 20 + [0, 0, 0]}, "compress_ratios"),
        (
            {"kv_source_layer_ids": [1, 2, 8, 14, 20], "index_source_layer_ids": [1, 2, 8, 14, 20]},
            "kv_source_layer_ids",
        ),
        # layer 20 (ratio 1) would read the ratio-2 cache of layer 14
        ({"kv_source_layer_ids": [2, 8, 14], "candidate_source_layer_id": -1}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [2, 8, 20, 24]}, "index_source_layer_ids"),
        ({"candidate_source_layer_id": 14}, "candidate_source_layer_id"),
        ({"engram_num_embeddings": [384006168, 384016683]}, "engram_num_embeddings"),
        ({"engram_pad_id": 3}, "engram_pad_id"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"num_hash_layers": 3}, "num_hash_layers"),
    ],
)
def test_bad_text_field_is_named(overrides, field):
    with pytest.raises(ConfigError, match=field):
        DeepseekV41Config.from_dict(_released(**overrides))


def test_kv_source_must_precede_every_compressed_layer():
    with pytest.raises(ConfigError, match="kv_source_layer_ids"):
        DeepseekV41Config.from_dict(
            _released(kv_source_layer_ids=[8, 14, 20], index_source_layer_ids=[8, 14, 20, 24, 28, 32, 36])
        )


def test_engram_pad_alias():
    cfg = DeepseekV41Config.from_dict(_released(engram_pad_id=2))
    assert cfg.engram_pad_token_id == 2
    text = {k: v for k, v in RELEASED_TEXT.items() if k != "engram_pad_token_id"}
    cfg = DeepseekV41Config.from_dict({**RELEASED, "text_config": {**text, "engram_pad_id": 2}})
    assert cfg.engram_pad_token_id == 2


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("weight_block_size", [128, 128]),
        ("scale_fmt", "float"),
        ("expert_dtype", "fp8"),
        ("quant_method", "int8"),
        ("activation_scheme", "static"),
        ("fmt", "e4m3"),
    ],
)
def test_bad_quantization_value_is_named(key, value):
    raw = copy.deepcopy(RELEASED)
    raw["quantization_config"][key] = value
    with pytest.raises(ConfigError, match=f"quantization_config.{key}"):
        DeepseekV41Config.from_dict(raw)


def test_root_fields_checked():
    with pytest.raises(ConfigError, match="dtype"):
        DeepseekV41Config.from_dict({**RELEASED, "dtype": "float16"})
    with pytest.raises(ConfigError, match="model_type"):
        DeepseekV41Config.from_dict({**RELEASED, "model_type": "deepseek_v4"})
    with pytest.raises(ConfigError, match="bos_token_id"):
        DeepseekV41Config.from_dict(_released(bos_token_id=5))


def _count(specs, cfg, prefix):
    return checkpoint_tensor_count([s for s in specs if s.name.startswith(prefix)], cfg)


def test_inventory_counts_match_docs():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    specs = v41_inventory(cfg)
    assert len({s.name for s in specs}) == len(specs)
    assert _count(specs, cfg, "layers.3.") == 2334  # reuse layer
    assert _count(specs, cfg, "layers.2.") == 2334 + 8  # ratio-2 KV source
    assert _count(specs, cfg, "layers.20.") == 2334 + 7  # ratio-1 KV source (no wgate)
    assert _count(specs, cfg, "layers.24.") == 2334 + 3  # reindex
    assert _count(specs, cfg, "layers.1.") == 2334 + 6  # Engram
    assert _count(specs, cfg, "layers.14.") == 2334 + 8 + 6
    assert _count(specs, cfg, "mtp.1.") == 798
    assert _count(specs, cfg, "mtp.0.") == 798 + 3
    assert _count(specs, cfg, "mtp.2.") == 798 + 4
    text_and_dspark = checkpoint_tensor_count(specs, cfg)
    assert text_and_dspark == 96085 - 266 == 95819
    with_vision = v41_inventory(cfg, include_vision=True)
    assert checkpoint_tensor_count(with_vision, cfg) == 96085
    assert checkpoint_tensor_count(v41_inventory(cfg, include_dspark=False), cfg) == 95819 - 3 * 798 - 7
    names = {s.name for s in specs}
    assert not any("hc_head" in n or "tid2eid" in n or ".ape" in n for n in names)
    assert sum(".compressor.wkv." in n for n in names) == 4 and sum(".compressor.wgate." in n for n in names) == 3
    assert sum(".indexer.wq_b." in n for n in names) == 8 and sum(".indexer.wk." in n for n in names) == 4


def test_inventory_shapes_match_docs():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    by_name = {s.name: s for s in v41_inventory(cfg)}
    stored = {name: (shape, dtype) for s in by_name.values() for name, shape, dtype in stored_tensors(s, cfg)}
    assert stored["layers.0.attn.wq_b.scale"] == ((1024, 40), "F8_E8M0")
    assert stored["layers.0.attn.wo_a.weight"] == ((8192, 4096), "F8_E4M3")
    assert stored["layers.0.ffn.experts.0.w1.weight"] == ((2304, 2560), "I8")
    assert stored["layers.0.ffn.experts.0.w2.scale"] == ((5120, 72), "F8_E8M0")
    assert stored["layers.0.ffn.gate.weight"] == ((384, 5120), "BF16")
    assert stored["layers.0.ffn.gate.bias_vl"] == ((384,), "F32")
    assert stored["layers.0.hc_attn_fn"] == ((24, 20480), "F32")
    assert stored["layers.2.attn.compressor.wgate.weight"] == ((512, 5120), "BF16")
    assert stored["layers.2.attn.indexer.wk.weight"] == ((128, 512), "BF16")
    assert stored["layers.24.attn.indexer.wq_b.scale"] == ((128, 40), "F8_E8M0")
    assert stored["layers.24.attn.indexer.weights_proj.weight"] == ((32, 5120), "BF16")
    assert by_name["layers.14.engram.embed.weight"].role == ENGRAM_TABLE
    assert stored["layers.14.engram.embed.weight"] == ((384016682, 256), "F8_E4M3")
    assert stored["layers.1.engram.embed.scale"] == ((384006168, 8), "F8_E8M0")
    assert stored["layers.1.engram.wkv.scale"] == ((800, 192), "F8_E8M0")
    assert stored["layers.1.engram.q_weight"] == ((4, 5120), "BF16")
    assert stored["mtp.0.main_proj.scale"] == ((160, 480), "F8_E8M0")
    assert stored["mtp.1.ffn.gate.weight"] == ((128, 5120), "BF16")
    assert stored["mtp.2.markov_head.head.weight"] == ((129280, 256), "BF16")
    assert stored["mtp.2.confidence_head.proj.weight"] == ((1, 5376), "BF16")
    assert "layers.20.attn.compressor.wgate.weight" not in stored

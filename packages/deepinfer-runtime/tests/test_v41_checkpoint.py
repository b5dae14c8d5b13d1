"""Tiny V4.1 checkpoints: writer output vs the inventory, loader decoding (32x32 FP8, MXFP4, Engram tables),
the CLI, and the KV-cache bytes per token."""

import json

import pytest
import torch
from deepinfer_kernels import fp8_block_dequantize, mxfp4_dequantize
from deepinfer_kernels.testing.compare import assert_rel_close, rel_err
from deepinfer_runtime import CheckpointError
from deepinfer_runtime.loader.safetensors_dir import SafetensorsDir
from deepinfer_runtime.loader.weights import check_inventory, decode_tensor, expected_names, load_engram_table
from deepinfer_runtime.models.deepseek_v4_weights import EXPERT, LINEAR, TensorSpec
from deepinfer_runtime.models.deepseek_v41_cache_bytes import cache_bytes_per_token, format_cache_bytes
from deepinfer_runtime.models.deepseek_v41_config import RELEASED_QUANT, DeepseekV41Config
from deepinfer_runtime.models.deepseek_v41_weights import (
    ENGRAM_TABLE,
    checkpoint_tensor_count,
    stored_tensors,
    v41_inventory,
)
from deepinfer_runtime.testing.tiny_checkpoint import main, tiny_v41_config, write_tiny_checkpoint
from safetensors.torch import save_file

SEED = 11
ST_DTYPE = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}


@pytest.fixture(scope="module")
def v41_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_v41")
    return {q: write_tiny_checkpoint(root / q.replace("+", "_"), "v4.1", q, seed=SEED) for q in ("none", "fp8+fp4")}


def _open(path):
    return DeepseekV41Config.from_file(path / "config.json"), SafetensorsDir(path)


def _spec(cfg, name):
    return next(s for s in v41_inventory(cfg) if s.name == name)


def test_tiny_v41_config_layout():
    raw = tiny_v41_config(sliding_window=32)
    assert raw["architectures"] == ["DeepseekV41ForCausalLM"] and raw["model_type"] == "deepseek_v41"
    assert (raw["dtype"], raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == ("bfloat16", 0, 1, 2)
    assert raw["image_token_id"] == 129264
    assert "vision_config" not in raw and "quantization_config" not in raw
    assert raw["text_config"]["sliding_window"] == 32  # overrides apply to text_config
    cfg = DeepseekV41Config.from_dict(raw)
    assert cfg.quant is None and cfg.vision_config is None and cfg.n_prefill_layer == 6
    assert cfg.engram_layer_ids == (1, 4) and cfg.num_nextn_predict_layers == 3


@pytest.mark.parametrize("quant", ["none", "fp8+fp4"])
def test_writer_matches_inventory(v41_dirs, quant):
    cfg, ckpt = _open(v41_dirs[quant])
    raw = json.loads((v41_dirs[quant] / "config.json").read_text())
    if quant == "none":
        assert "quantization_config" not in raw and cfg.quant is None
    else:
        assert raw["quantization_config"] == RELEASED_QUANT and cfg.quant.weight_block_size == (32, 32)
    inventory = v41_inventory(cfg)
    assert any(s.name.startswith("mtp.2.markov_head") for s in inventory)  # DSpark is included
    check_inventory(inventory, ckpt, ())
    assert expected_names(inventory, ckpt) == ckpt.names()
    assert len(ckpt.names()) == checkpoint_tensor_count(inventory, cfg)
    roles = {s.role for s in inventory}
    assert {LINEAR, EXPERT, ENGRAM_TABLE} <= roles
    for spec in inventory:
        for name, shape, dtype in stored_tensors(spec, cfg):
            t = ckpt.get(name)
            assert (t.dtype, tuple(t.shape)) == (ST_DTYPE[dtype], shape), name
            if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
                assert torch.isfinite(t).all(), name
    tok = v41_dirs[quant] / "tokenizer.json"
    assert tok.is_file() and tok.stat().st_size > 1_000_000


def test_v41_rejects_fp8_experts(tmp_path):
    with pytest.raises(ValueError, match="fp4"):
        write_tiny_checkpoint(tmp_path / "x", "v4.1", "fp8")
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="arch"):
        write_tiny_checkpoint(tmp_path / "y", "v5", "none")


def test_decode_quantised_linear_and_expert(v41_dirs):
    cfg, ckpt = _open(v41_dirs["fp8+fp4"])
    cfg0, ckpt0 = _open(v41_dirs["none"])
    for name in ("layers.2.attn.wq_b.weight", "layers.4.engram.wkv.weight", "mtp.0.main_proj.weight"):
        spec = _spec(cfg, name)
        assert spec.role == LINEAR
        got = decode_tensor(spec, ckpt, cfg.quant, torch.float32)
        raw, scale = ckpt.get(name), ckpt.get(name.removesuffix(".weight") + ".scale")
        assert raw.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(got, fp8_block_dequantize(raw, scale, (32, 32)))
        # same seed -> same weights: the unquantised checkpoint holds the bf16 original
        assert_rel_close(got, decode_tensor(spec, ckpt0, None, torch.float32), 0.07, name)
    name = "layers.6.ffn.experts.3.w2.weight"
    spec = _spec(cfg, name)
    assert spec.role == EXPERT
    got = decode_tensor(spec, ckpt, cfg.quant, torch.float32)
    assert torch.equal(got, mxfp4_dequantize(ckpt.get(name), ckpt.get(name.removesuffix(".weight") + ".scale")))
    assert_rel_close(got, decode_tensor(spec, ckpt0, None, torch.float32), 0.2, name)


@pytest.mark.parametrize("layer", [1, 4])
def test_load_engram_table(v41_dirs, layer):
    cfg, ckpt = _open(v41_dirs["fp8+fp4"])
    cfg0, ckpt0 = _open(v41_dirs["none"])
    spec = _spec(cfg, f"layers.{layer}.engram.embed.weight")
    assert spec.role == ENGRAM_TABLE and spec.shape == (cfg.engram_rows(layer), 64)
    rows, scale = load_engram_table(spec, ckpt, cfg.quant)
    assert rows.dtype == torch.float8_e4m3fn and tuple(rows.shape) == spec.shape
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == (spec.shape[0], 2)
    orig, none_scale = load_engram_table(spec, ckpt0, None)
    assert none_scale is None and orig.dtype == torch.bfloat16 and tuple(orig.shape) == spec.shape
    assert 0.9 < orig.float().std() < 1.1  # rows N(0, 1)
    deq = fp8_block_dequantize(rows, scale, (1, 32))
    err = rel_err(deq, orig.float())
    assert err < 0.07, err
    # decode_tensor dequantises the same way (reference path for tiny checkpoints)
    assert torch.equal(decode_tensor(spec, ckpt, cfg.quant, torch.float32), deq)
    assert torch.equal(decode_tensor(spec, ckpt0, None, torch.float32), orig.float())


def test_load_engram_table_errors_name_the_tensor(tmp_path, v41_dirs):
    cfg, ckpt = _open(v41_dirs["fp8+fp4"])
    spec = _spec(cfg, "layers.1.engram.embed.weight")
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.weight.*quantization_config"):
        load_engram_table(spec, ckpt, None)
    with pytest.raises(ValueError, match="role"):
        load_engram_table(_spec(cfg, "layers.1.engram.wkv.weight"), ckpt, cfg.quant)

    name = "layers.1.engram.embed.weight"
    rows = torch.randn(64, 64).to(torch.float8_e4m3fn)
    good_scale = torch.full((64, 2), 127, dtype=torch.uint8)
    cases = {
        "bad_scale_shape": ({name: rows, "layers.1.engram.embed.scale": good_scale[:, :1].contiguous()}, "scale"),
        "bad_scale_dtype": ({name: rows, "layers.1.engram.embed.scale": torch.ones(64, 2)}, "float8_e8m0fnu"),
        "bad_rows_dtype": ({name: torch.randn(64, 64), "layers.1.engram.embed.scale": good_scale}, "float8_e4m3fn"),
        "fp8_without_scale": ({name: rows}, "without"),
        "bad_rows_shape": ({name: torch.randn(64, 32, dtype=torch.bfloat16)}, "shape"),
    }
    spec = TensorSpec(name, (64, 64), ENGRAM_TABLE)
    for case, (tensors, match) in cases.items():
        d = tmp_path / case
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match) as info:
            load_engram_table(spec, SafetensorsDir(d), cfg.quant)
        assert "layers.1.engram.embed" in str(info.value), case
    # raw uint8 scale bytes are accepted and reinterpreted as e8m0
    d = tmp_path / "uint8_scale"
    d.mkdir()
    save_file({name: rows, "layers.1.engram.embed.scale": good_scale}, str(d / "model.safetensors"))
    got_rows, got_scale = load_engram_table(spec, SafetensorsDir(d), cfg.quant)
    assert got_scale.dtype == torch.float8_e8m0fnu and torch.equal(got_scale.view(torch.uint8), good_scale)


def test_engram_scale_is_an_expected_companion(v41_dirs):
    """check_inventory / expected_names treat ENGRAM_TABLE like LINEAR for the .scale companion."""
    cfg, ckpt = _open(v41_dirs["fp8+fp4"])
    inventory = v41_inventory(cfg)
    assert {"layers.1.engram.embed.scale", "layers.4.engram.embed.scale"} <= expected_names(inventory, ckpt)
    without = [s for s in inventory if s.name != "layers.4.engram.embed.weight"]
    with pytest.raises(CheckpointError, match=r"2 unexpected.*layers\.4\.engram\.embed\.scale"):
        check_inventory(without, ckpt, ())


def test_cli_writes_v41(tmp_path, capsys):
    out = tmp_path / "cli"
    main(["--arch", "v4.1", "--out", str(out), "--quant", "fp8+fp4", "--seed", "3"])
    assert "v4.1" in capsys.readouterr().out
    cfg, ckpt = _open(out)
    assert cfg.quant is not None and cfg.quant.expert_dtype == "fp4"
    check_inventory(v41_inventory(cfg), ckpt, ())
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()
    with pytest.raises(SystemExit):
        main(["--arch", "v4.1", "--out", str(tmp_path / "bad"), "--quant", "fp8"])


# the released text_config (model_v41_flash.md section 1.2)
RELEASED_TEXT = {
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
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
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
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}


def test_cache_bytes_released():
    cfg = DeepseekV41Config.from_dict({**tiny_v41_config(), "text_config": RELEASED_TEXT})
    d = cache_bytes_per_token(cfg)
    table = format_cache_bytes(d)
    print("\nreleased V4.1-Flash\n" + table)
    assert d["record_bytes"] == {"window": 528, "compressed_kv": 288, "index_key": 68}
    per = {k: v["bytes_per_token"] for k, v in d["per_token"].items()}
    assert per == {"compressed_kv_r2": 432, "compressed_kv_r1": 288, "index_key_r2": 102, "index_key_r1": 68}
    assert d["per_token"]["compressed_kv_r2"]["owners"] == (2, 8, 14)
    assert d["per_token"]["index_key_r1"]["owners"] == (20,)
    assert d["per_token_total"] == 890
    fixed = {k: v["bytes"] for k, v in d["per_request"].items()}
    assert fixed == {
        "window": 40 * 134 * 528,  # 2.83 MB, section 12
        "dspark_window": 3 * 134 * 528,  # 0.21 MB
        "compressor_tail": 3 * (2 - 1 + 6) * 2 * 512 * 4,  # layers 2, 8, 14: 7 fp32 wkv + wgate rows
        "engram_lookback": 3 * 8,
    }
    assert d["per_request_total"] == sum(fixed.values())
    assert "890" in table and "2,830,080" in table
    # bare ring (no backtracking): 2.70 MB of window KV
    assert cache_bytes_per_token(cfg, backtracking=0)["per_request"]["window"]["bytes"] == 40 * 128 * 528


def test_cache_bytes_tiny():
    cfg = DeepseekV41Config.from_dict(tiny_v41_config())
    d = cache_bytes_per_token(cfg)
    print("\ntiny V4.1\n" + format_cache_bytes(d))
    assert d["record_bytes"] == {"window": 128 + 4, "compressed_kv": 64 + 8, "index_key": 32 + 2}
    # KV sources 2, 4 (ratio 2) and 6 (ratio 1)
    assert d["per_token_total"] == 2 * 72 / 2 + 72 + 2 * 34 / 2 + 34 == 212
    fixed = {k: v["bytes"] for k, v in d["per_request"].items()}
    assert fixed == {
        "window": 12 * 22 * 132,
        "dspark_window": 3 * 22 * 132,
        "compressor_tail": 2 * 7 * 2 * 128 * 4,
        "engram_lookback": 24,
    }
    with pytest.raises(ValueError, match="backtracking"):
        cache_bytes_per_token(cfg, backtracking=-1)

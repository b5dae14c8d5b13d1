"""Checkpoint loading: quantised formats, shard layouts, and clear errors on bad directories."""

import json
import shutil

import pytest
import torch
from deepinfer_kernels import fp8_block_dequantize, mxfp4_dequantize
from deepinfer_kernels.testing.compare import assert_rel_close
from deepinfer_runtime import CheckpointError, ConfigError, load_model
from deepinfer_runtime.loader.shard import LoadShard
from deepinfer_runtime.testing.tiny_checkpoint import write_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file


def _dequantised_twin(src, dst):
    """Rewrite a quantised checkpoint with every quantised weight dequantised to bf16."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])
    cfg.pop("expert_dtype", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        with safe_open(src / shard, "pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        out = {}
        for name, t in tensors.items():
            if name.endswith(".scale"):
                continue
            scale_name = name[: -len(".weight")] + ".scale"
            if scale_name in index["weight_map"]:
                with safe_open(src / index["weight_map"][scale_name], "pt") as fh:
                    scale = fh.get_tensor(scale_name)
                if t.dtype == torch.int8:
                    t = mxfp4_dequantize(t, scale)
                else:
                    t = fp8_block_dequantize(t, scale, block)
                t = t.to(torch.bfloat16)
            out[name] = t
        save_file(out, str(dst / shard))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith(".scale")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("quant", ["fp8", "fp8+fp4"])
def test_quantised_checkpoint_equals_its_dequantised_twin(tmp_path, quant):
    q = write_tiny_checkpoint(tmp_path / "q", "v4", quant, seed=3)
    names = json.loads((q / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.endswith("experts.0.w1.scale") for n in names) and "layers.0.attn.wq_a.scale" in names
    twin = _dequantised_twin(q, tmp_path / "twin")
    ids = torch.randint(0, 129280, (1, 40), generator=torch.Generator().manual_seed(0))
    a = load_model(q, dtype=torch.float32, progress=False).forward_logits(ids)
    b = load_model(twin, dtype=torch.float32, progress=False).forward_logits(ids)
    assert torch.equal(a, b)


def test_quantised_checkpoint_stays_close_to_unquantised(tmp_path):
    ids = torch.randint(0, 129280, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = load_model(
        write_tiny_checkpoint(tmp_path / "n", "v4", "none", seed=4), torch.float32, progress=False
    ).forward_logits(ids)
    q = load_model(
        write_tiny_checkpoint(tmp_path / "q", "v4", "fp8+fp4", seed=4), torch.float32, progress=False
    ).forward_logits(ids)
    assert_rel_close(q, ref, 0.5, "fp8+fp4 vs bf16 weights")  # same seed: same underlying weights


def test_single_file_checkpoint_and_bf16(tmp_path):
    src = write_tiny_checkpoint(tmp_path / "sharded", "v4", "none", seed=5, num_shards=1)
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(src / "config.json", single)
    shutil.copy(src / "model-00001-of-00001.safetensors", single / "model.safetensors")
    ids = torch.randint(0, 129280, (1, 20), generator=torch.Generator().manual_seed(2))
    a = load_model(src, torch.float32, progress=False).forward_logits(ids)
    assert torch.equal(a, load_model(single, torch.float32, progress=False).forward_logits(ids))
    b = load_model(src, "bfloat16", progress=False).forward_logits(ids)
    assert b.dtype == torch.float32 and (b.argmax(-1) == a.argmax(-1)).float().mean() > 0.5


def _drop_tensor(d, name, replacement=None):
    """Remove ``name`` from the checkpoint ``d`` (and put ``replacement`` = (name, tensor) in its shard)."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(name)
    with safe_open(d / shard, "pt") as fh:
        kept = {k: fh.get_tensor(k) for k in fh.keys() if k != name}
    if replacement is not None:
        kept[replacement[0]] = replacement[1]
        index["weight_map"][replacement[0]] = shard
    save_file(kept, str(d / shard))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


# a rank's loader (rank 1 of 2 holds experts 4..7) reports a broken checkpoint exactly as the whole-model loader
@pytest.mark.parametrize("shard", [None, LoadShard(1, 2)], ids=["whole", "rank_share"])
def test_bad_directories_give_clear_errors(tmp_path, shard):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope", shard=shard)
    good = write_tiny_checkpoint(tmp_path / "good", "v4", "none", seed=6)

    def variant(name):
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    d = variant("missing_shard")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_model(d, progress=False, shard=shard)

    d = variant("corrupt_shard")
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(d, progress=False, shard=shard)

    d = variant("missing_tensor")
    _drop_tensor(d, "layers.1.attn.wq_a.weight", ("layers.1.attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"missing tensor.*wq_a.*unexpected tensor.*bogus"):
        load_model(d, progress=False, shard=shard)

    d = variant("missing_expert")  # an expert rank 1 does not hold: still a broken checkpoint
    _drop_tensor(d, "layers.0.ffn.experts.0.w2.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor.*experts\.0\.w2"):
        load_model(d, progress=False, shard=shard)

    d = variant("bad_config")
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(d, progress=False, shard=shard)
    cfg["mystery_knob"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mystery_knob"):
        load_model(d, progress=False, shard=shard)
    with pytest.raises(ValueError, match="dtype"):
        load_model(good, dtype="int8", shard=shard)


def test_forward_logits_rejects_bad_ids(tmp_path):
    model = load_model(write_tiny_checkpoint(tmp_path / "m", "v4", "none", seed=7), torch.float32, progress=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.forward_logits(torch.tensor([[5, 129280]]))
    with pytest.raises(ValueError, match="integer tensor"):
        model.forward_logits(torch.zeros(1, 3))

"""rms_norm and the interleaved / YaRN RoPE against transformers' DeepSeek-V4 submodules."""

import math

import pytest
import torch
from deepinfer_kernels import YarnScaling, rms_norm, rope_interleaved, rope_inv_freq
from deepinfer_kernels.testing.compare import assert_rel_close

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402


def _hf_config(**kw):
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=16,
        vocab_size=100,
        rope_scaling={
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    base.update(kw)
    return DeepseekV4Config(**base)


@pytest.mark.parametrize("eps", [1e-6, 1e-20])
def test_rms_norm_matches_transformers(eps):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 64, generator=g)
    w = torch.randn(64, generator=g)
    mod = hf.DeepseekV4RMSNorm(64, eps=eps)
    mod.weight.data.copy_(w)
    assert_rel_close(rms_norm(x, w, eps), mod(x), 1e-6, "weighted")
    assert_rel_close(rms_norm(x, None, eps), hf.DeepseekV4UnweightedRMSNorm(eps)(x), 1e-6, "unweighted")


def test_rms_norm_zero_row_and_bf16():
    x = torch.zeros(2, 8)
    assert torch.equal(rms_norm(x, None, 1e-20), x)
    xb = torch.randn(5, 8).bfloat16()
    assert rms_norm(xb, torch.ones(8), 1e-6).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(xb, torch.ones(7), 1e-6)


def test_yarn_inv_freq_matches_transformers_and_spec():
    cfg = _hf_config()
    emb = hf.DeepseekV4RotaryEmbedding(cfg)
    yarn = YarnScaling(16, 65536, 32, 1)
    assert torch.equal(rope_inv_freq(16, 10000.0), emb.main_inv_freq)
    assert_rel_close(rope_inv_freq(16, 160000.0, yarn), emb.compress_inv_freq, 1e-7, "yarn")
    # spec 1.3: at the released 64 rope dims, pairs 0-15 unchanged, 25-31 divided by 16
    plain, scaled = rope_inv_freq(64, 160000.0), rope_inv_freq(64, 160000.0, yarn)
    assert torch.equal(scaled[:16], plain[:16])
    assert torch.allclose(scaled[25:], plain[25:] / 16)
    assert ((scaled[16:25] < plain[16:25]) & (scaled[16:25] > plain[16:25] / 16)).all()


@pytest.mark.parametrize("layer_type", ["main", "compress"])
def test_rope_matches_transformers(layer_type):
    cfg = _hf_config()
    emb = hf.DeepseekV4RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(2)
    t, heads = 11, 4
    x = torch.randn(1, heads, t, 32, generator=g)  # HF layout [B, H, S, D]
    pos = torch.randint(0, 5000, (t,), generator=g)
    cos, sin = emb(x, pos[None], layer_type=layer_type)
    want = hf.apply_rotary_pos_emb(x, cos, sin)
    inv = getattr(emb, f"{layer_type}_inv_freq")
    got = rope_interleaved(x[0].transpose(0, 1), pos, inv).transpose(0, 1)[None]
    assert_rel_close(got, want, 1e-6, "rope")
    back = hf.apply_rotary_pos_emb(want, cos, -sin)
    got_back = rope_interleaved(got[0].transpose(0, 1), pos, inv, inverse=True).transpose(0, 1)[None]
    assert_rel_close(got_back, back, 1e-6, "inverse rope")
    assert_rel_close(got_back, x, 1e-5, "round trip")


def test_rope_pairs_are_adjacent_and_nope_untouched():
    x = torch.zeros(1, 8)
    x[0, 4] = 1.0  # first channel of the rope slice (pair 0 = channels 4, 5)
    inv = torch.tensor([1.0, 0.5])
    y = rope_interleaved(x, torch.tensor([1]), inv)
    assert torch.allclose(y[0, 4:6], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    assert torch.equal(y[0, :4], x[0, :4]) and torch.equal(y[0, 6:], x[0, 6:])
    with pytest.raises(ValueError, match="positions"):
        rope_interleaved(x, torch.tensor([1, 2]), inv)

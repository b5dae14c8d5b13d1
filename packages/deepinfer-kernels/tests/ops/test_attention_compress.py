"""sparse_mqa_attention, kv_compress_pool / overlap_windows and grouped_linear against
transformers' DeepSeek-V4 attention core, compressors and grouped output projection."""

import pytest
import torch
from deepinfer_kernels import (
    grouped_linear,
    kv_compress_pool,
    overlap_windows,
    rms_norm,
    rope_interleaved,
    sparse_mqa_attention,
)
from deepinfer_kernels.testing.compare import assert_rel_close

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402


def _cfg(**kw):
    base = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=16,
        vocab_size=100,
        index_n_heads=16,
        index_head_dim=32,
        q_lora_rank=32,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
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


def _randomize(module, gen):
    for p in module.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_sparse_mqa_matches_transformers_eager_with_sinks():
    g = torch.Generator().manual_seed(3)
    t, h, d, n = 9, 4, 32, 20
    q = torch.randn(t, h, d, generator=g)
    kv = torch.randn(n, d, generator=g)
    sinks = torch.randn(h, generator=g)
    idx = torch.stack([torch.randperm(n, generator=g)[:6] for _ in range(t)])
    idx[0, 3:] = -1  # unused slots
    # oracle: dense eager attention with a -inf mask outside each row's indices
    mask = torch.full((t, n), float("-inf"))
    for i in range(t):
        mask[i, idx[i][idx[i] >= 0]] = 0.0

    class Holder(torch.nn.Module):
        num_key_value_groups, training = h, False

    holder = Holder()
    holder.sinks = sinks
    want, _ = hf.eager_attention_forward(
        holder, q.transpose(0, 1)[None], kv[None, None], kv[None, None], mask[None, None], scaling=d**-0.5
    )
    got = sparse_mqa_attention(q, kv, idx, sinks, d**-0.5)
    assert_rel_close(got, want[0], 1e-6, "attention")


def test_sparse_mqa_fully_masked_row_is_zero_and_order_free():
    g = torch.Generator().manual_seed(4)
    q, kv, sinks = torch.randn(2, 2, 8, generator=g), torch.randn(5, 8, generator=g), torch.zeros(2)
    idx = torch.tensor([[-1, -1, -1], [0, 3, 4]])
    out = sparse_mqa_attention(q, kv, idx, sinks, 0.3)
    assert torch.equal(out[0], torch.zeros(2, 8))
    out_perm = sparse_mqa_attention(q, kv, idx[:, [2, 0, 1]], sinks, 0.3)
    assert_rel_close(out_perm, out, 1e-6, "permuted indices")


def _ours_compress(mod, x, ratio, overlap, inv_freq, eps):
    kv = torch.nn.functional.linear(x, mod.kv_proj.weight)
    score = torch.nn.functional.linear(x, mod.gate_proj.weight)
    w = x.shape[0] // ratio
    kv, score = kv[: w * ratio].view(w, ratio, -1), score[: w * ratio].view(w, ratio, -1) + mod.position_bias
    if overlap:
        kv, score = overlap_windows(kv, score)
    pooled = rms_norm(kv_compress_pool(kv, score), mod.kv_norm.weight, eps)
    return rope_interleaved(pooled, torch.arange(w) * ratio, inv_freq)


@pytest.mark.parametrize("ratio", [8, 2, 1])
def test_hca_compressor_matches_transformers(ratio):
    """Ratio 8 exercises HCA; ratios 2 and 1 with zero position bias are V4.1's KV-source compressors
    (architecture.md section 6: the HCA compressor at rate 2 / 1 with no bias; at rate 1 the pool is the
    identity, so the entry is norm(wkv x) as V4.1's ratio-1 compressor computes it)."""
    cfg = _cfg(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": ratio})
    g = torch.Generator().manual_seed(5)
    mod = hf.DeepseekV4HCACompressor(cfg)
    _randomize(mod, g)
    if ratio <= 2:
        mod.position_bias.data.zero_()
    mod.kv_norm.weight.data.copy_(1 + 0.1 * torch.randn(32, generator=g))
    x = torch.randn(1, 35, 64, generator=g)  # several full windows plus a remainder
    want, _ = mod(x, None, torch.arange(35)[None], None, 0)
    got = _ours_compress(mod, x[0], ratio, False, mod.rotary_emb.compress_inv_freq, cfg.rms_norm_eps)
    assert_rel_close(got, want[0, 0], 1e-6, "HCA entries")


def test_csa_overlapping_compressor_matches_transformers_and_chunking():
    cfg = _cfg()
    g = torch.Generator().manual_seed(6)
    mod = hf.DeepseekV4Indexer(cfg)  # same overlapping compressor at index_head_dim
    _randomize(mod, g)
    x = torch.randn(1, 26, 64, generator=g)
    # the indexer's compressor output is internal: rebuild it the way the module does
    kv = mod.kv_proj(x)[0, :24].view(6, 4, -1)
    score = mod.gate_proj(x)[0, :24].view(6, 4, -1) + mod.position_bias
    lay_kv, lay_score = overlap_windows(kv, score)
    # slot semantics (spec A.5): entry w pools A-halves of window w-1 and B-halves of window w
    assert torch.equal(lay_kv[3, :4], kv[2, :, :32]) and torch.equal(lay_kv[3, 4:], kv[3, :, 32:])
    assert torch.isinf(lay_score[0, :4]).all() and torch.equal(lay_kv[0, :4], torch.zeros(4, 32))
    # chunked: the last window's A-half carried into the next chunk gives the same layout
    k2, s2 = overlap_windows(kv[3:], score[3:], kv[2, :, :32], score[2, :, :32])
    assert torch.equal(k2, lay_kv[3:]) and torch.equal(s2, lay_score[3:])
    # and against the module end to end through the CSA compressor class
    csa = hf.DeepseekV4CSACompressor(cfg)
    _randomize(csa, g)
    xs = torch.randn(1, 24, 64, generator=g)
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=_cfg(num_hidden_layers=1, layer_types=["compressed_sparse_attention"]))
    want, _ = csa(
        xs,
        csa.q_a_proj(xs) if hasattr(csa, "q_a_proj") else torch.randn(1, 24, 32, generator=g),
        torch.arange(24)[None],
        cache,
        0,
    )
    got = _ours_compress(csa, xs[0], 4, True, csa.rotary_emb.compress_inv_freq, cfg.rms_norm_eps)
    assert_rel_close(got, want[0, 0], 1e-6, "CSA entries")


def test_kv_compress_pool_softmax_and_empty_slots():
    kv = torch.tensor([[[1.0], [3.0]]])
    score = torch.tensor([[[0.0], [float("-inf")]]])
    assert torch.equal(kv_compress_pool(kv, score), torch.tensor([[1.0]]))
    score = torch.zeros(1, 2, 1)
    assert torch.equal(kv_compress_pool(kv, score), torch.tensor([[2.0]]))


def test_grouped_linear_matches_transformers():
    g = torch.Generator().manual_seed(7)
    mod = hf.DeepseekV4GroupedLinear(48, 2 * 16, 2)
    mod.weight.data.copy_(torch.randn(32, 48, generator=g))
    x = torch.randn(5, 2, 48, generator=g)
    assert_rel_close(grouped_linear(x, mod.weight), mod(x), 1e-6, "grouped linear")
    with pytest.raises(ValueError):
        grouped_linear(x, torch.randn(33, 48))

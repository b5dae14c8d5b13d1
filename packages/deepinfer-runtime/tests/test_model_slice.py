"""Model slices for the GPU benchmark (testing/model_slice.py), at tiny dimensions on the CPU."""

import pytest
import torch
from deepinfer_runtime.testing import model_slice as ms

V41_TINY = dict(
    hidden_size=128, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=64, o_groups=4,
    o_lora_rank=32, n_routed_experts=16, moe_intermediate_size=64, index_n_heads=16, index_head_dim=64, index_topk=8,
    sliding_window=16, candidate_topk_blocks=4, candidate_block_size=4, engram_head_dim=64, vocab_size=4096,
)  # fmt: skip
V4_TINY = dict(
    hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, n_routed_experts=8, moe_intermediate_size=32, index_n_heads=16, index_head_dim=32, index_topk=8,
    sliding_window=16, num_experts_per_tok=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
)  # fmt: skip


def test_v41_slice_keeps_each_layer_kind():
    cfg = ms.v41_slice_config()  # real dimensions, released layers 0 1 2 3 20 21 24 25
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 5120 and cfg.n_routed_experts == 384
    roles = [cfg.layer_role(i) for i in range(8)]
    assert roles == ["window", "window", "kv_source", "reuse", "kv_source", "reuse", "reindex", "reuse"]
    assert cfg.compress_ratios[:8] == (0, 0, 2, 2, 1, 1, 1, 1)
    assert cfg.candidate_source_layer_id == 4 and cfg.n_prefill_layer == 4
    assert cfg.engram_layer_ids == (1,) and cfg.engram_num_embeddings[0] < 10_000_000  # reduced table
    assert [cfg.kv_source_of(i) for i in (3, 5, 6, 7)] == [2, 4, 4, 4]
    assert [cfg.index_source_of(i) for i in (3, 5, 6, 7)] == [2, 4, 6, 6]


def test_v41_slice_refuses_a_layer_without_its_source():
    with pytest.raises(ValueError, match="source"):
        ms.v41_slice_raw((0, 1, 3))  # layer 3 reads layer 2's compressed KV


def test_v4_slice_config():
    cfg = ms.v4_slice_config()
    assert cfg.layer_types == ms.V4_SLICE_LAYER_TYPES and cfg.hidden_size == 4096 and cfg.n_routed_experts == 256
    assert [cfg.is_hash_layer(i) for i in range(4)] == [True, False, False, False]


@pytest.mark.parametrize("experts", ["distinct", "shared"])
def test_random_v41_slice_runs_and_clone_state_is_independent(experts):
    cfg = ms.v41_slice_config(engram_vocab_size=100, **V41_TINY)
    model = ms.build_random_model(cfg, "cpu", torch.float32, experts=experts)
    w13 = [b.ffn.experts.w13 for b in model.layers]
    assert all(w.shape == (16, 128, 128) for w in w13)
    assert (len({id(w) for w in w13}) == 1) == (experts == "shared")
    assert model.layers[0].ffn.gate.weight.shape == (16, 128) and model.cfg is cfg
    ids = torch.randint(3, 4000, (40,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    first = model.forward_step([ids], [cache], prompt_lens=[40])[0][-1]
    assert torch.isfinite(first).all()
    copy = ms.clone_state(cache)
    a = model.forward_step([ids[:1]], [cache])[0]
    b = model.forward_step([ids[:1]], [copy])[0]
    assert torch.equal(a, b) and cache.seq_len == copy.seq_len == 41


def _loads(model, ids) -> list[torch.Tensor]:
    """Each top-k router's expert loads over one forward of ids (no prompt length: every layer sees every row)."""
    gates = [m for m in model.modules() if type(m).__name__ == "Gate" and hasattr(m, "bias")]
    seen = {}
    hooks = [g.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o[1])) for k, g in enumerate(gates)]
    try:
        model.forward_step([ids], [model.new_cache()], logit_rows=[torch.tensor([ids.shape[0] - 1])])
    finally:
        for h in hooks:
            h.remove()
    return [torch.bincount(seen[k].reshape(-1).long(), minlength=g.bias.numel()).float() for k, g in enumerate(gates)]


@pytest.mark.parametrize("arch", ["v4.1", "v4"])
def test_balance_routers_spreads_the_load(arch):
    """The random biases send most rows to few experts; balancing moves every top-k router's bias until each
    expert's load is near the mean, the busiest and the least busy (checked on tokens it never saw: tiny V4.1 2.67
    -> 1.32 / 0.75, V4 3.42 -> 1.28 / 0.83), and leaves the hash router alone."""
    if arch == "v4.1":
        model = ms.build_random_model(ms.v41_slice_config(engram_vocab_size=100, **V41_TINY), "cpu", torch.float32)
    else:
        model = ms.build_random_model(ms.v4_slice_config(**V4_TINY, vocab_size=4096), "cpu", torch.float32)
    fresh = torch.randint(3, 4000, (256,), generator=torch.Generator().manual_seed(5))
    hashed = [m.tid2eid.clone() for m in model.modules() if hasattr(m, "tid2eid")]
    before = max(float(x.max() / x.mean()) for x in _loads(model, fresh))
    ratios = ms.balance_routers_(model, tokens=256, iters=20)
    loads = _loads(model, fresh)
    after = max(float(x.max() / x.mean()) for x in loads)
    least = min(float(x.min() / x.mean()) for x in loads)  # no expert left idle
    assert len(ratios) == 20 and before > 2.5 and after < 1.45 and least > 0.6, (before, after, least, ratios)
    assert all(torch.equal(a, m.tid2eid) for a, m in zip(hashed, (m for m in model.modules() if hasattr(m, "tid2eid"))))
    assert (arch == "v4") == bool(hashed)


def test_transformers_over_the_same_weights_matches_ours():
    pytest.importorskip("transformers")
    raw = ms.v4_slice_raw(**V4_TINY)
    cfg = ms.v4_slice_config(**V4_TINY)
    model = ms.build_random_model(cfg, "cpu", torch.float32)
    hf = ms.hf_v4_sharing_weights(model, raw, dtype=torch.float32)
    assert hf.model.embed_tokens.weight.data_ptr() == model.embed.weight.data_ptr()
    assert hf.model.layers[1].mlp.experts.gate_up_proj.data_ptr() == model.layers[1].ffn.experts.w13.data_ptr()
    ids = torch.randint(3, 4000, (2, 60), generator=torch.Generator().manual_seed(1))
    ours = model.forward_logits(ids)
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits.float()
    assert ((ours - ref).norm() / ref.norm()) < 1e-4

"""MoE ops against transformers' DeepSeek-V4 modules (fp32 oracle) and spec properties."""

import pytest
import torch
import torch.nn.functional as F
from deepinfer_kernels.ops.moe import moe_experts, moe_route_hash, moe_route_topk, swiglu_clamp, swiglu_mlp
from deepinfer_kernels.registry import list_ops
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

TOL = 1e-5
D, I, E, K, V = 64, 32, 8, 2, 100
B, S = 3, 7
T = B * S
LIMIT = 2.0  # small swiglu_limit so the clamps engage with moderate weights
SCALE = 1.5


def _hf_config(**kw) -> DeepseekV4Config:
    args = dict(
        vocab_size=V,
        hidden_size=D,
        moe_intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        sliding_window=8,
        n_routed_experts=E,
        num_experts_per_tok=K,
        routed_scaling_factor=SCALE,
        swiglu_limit=LIMIT,
        layer_types=["sliding_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe"],
    )
    args.update(kw)
    cfg = DeepseekV4Config(**args)
    cfg._experts_implementation = "eager"
    return cfg


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, std=1.0):
    return torch.randn(*shape, generator=g) * std


def _tid2eid(g, rows=V, k=K, e=E):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])


def _sorted_by_expert(weights, experts):
    """Canonical per-row order (ascending expert id) so unordered top-k picks compare as sets."""
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


@torch.no_grad()
def _fill_moe(moe, g):
    moe.gate.weight.copy_(_randn(g, E, D, std=0.3))
    if moe.is_hash:
        moe.gate.tid2eid.copy_(_tid2eid(g))
    else:
        moe.gate.e_score_correction_bias.copy_(_randn(g, E, std=0.5))
    moe.experts.gate_up_proj.copy_(_randn(g, E, 2 * I, D, std=0.3))
    moe.experts.down_proj.copy_(_randn(g, E, D, I, std=0.3))
    for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        lin.weight.copy_(_randn(g, *lin.weight.shape, std=0.3))


def test_references_registered():
    ops = list_ops()
    for name in ("moe_route_topk", "moe_route_hash", "swiglu_clamp", "moe_experts", "swiglu_mlp"):
        assert name in ops


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@torch.no_grad()
def test_topk_router_matches_transformers(scoring):
    g = _gen(1)
    router = hf.DeepseekV4TopKRouter(_hf_config(scoring_func=scoring))
    router.weight.copy_(_randn(g, E, D, std=0.3))
    router.e_score_correction_bias.copy_(_randn(g, E, std=0.5))
    x = _randn(g, B, S, D)
    logits_ref, w_ref, idx_ref = router(x)

    logits = x.reshape(T, D) @ router.weight.t()
    assert_rel_close(logits, logits_ref, TOL, "logits")
    w, idx = moe_route_topk(logits, router.e_score_correction_bias, K, route_scale=SCALE, scoring=scoring)
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (T, K)
    w, idx = _sorted_by_expert(w, idx)
    w_ref, idx_ref = _sorted_by_expert(w_ref, idx_ref)
    assert torch.equal(idx, idx_ref)
    assert_rel_close(w, w_ref, TOL, "weights")


@torch.no_grad()
def test_hash_router_matches_transformers():
    g = _gen(2)
    router = hf.DeepseekV4HashRouter(_hf_config())
    router.weight.copy_(_randn(g, E, D, std=0.3))
    router.tid2eid.copy_(_tid2eid(g))
    x = _randn(g, B, S, D)
    ids = torch.randint(0, V, (B, S), generator=g)
    logits_ref, w_ref, idx_ref = router(x, ids)

    w, idx = moe_route_hash(logits_ref, router.tid2eid, ids.reshape(-1), route_scale=SCALE)
    assert torch.equal(idx, idx_ref)  # hash selection keeps table order
    assert_rel_close(w, w_ref, TOL, "weights")


@torch.no_grad()
def test_experts_match_transformers():
    g = _gen(3)
    experts = hf.DeepseekV4Experts(_hf_config())
    experts.gate_up_proj.copy_(_randn(g, E, 2 * I, D, std=0.3))
    experts.down_proj.copy_(_randn(g, E, D, I, std=0.3))
    x = _randn(g, T, D)
    # only experts 1..5 are hit (unhit experts, some tokens twice on one expert)
    idx = torch.randint(1, 6, (T, K), generator=g)
    w = torch.rand(T, K, generator=g) + 0.1
    expected = experts(x, idx, w)
    out = moe_experts(x, idx, w, experts.gate_up_proj, experts.down_proj, swiglu_limit=LIMIT)
    assert_rel_close(out, expected, TOL, "experts")


@torch.no_grad()
def test_shared_mlp_matches_transformers_with_clamps_engaged():
    g = _gen(4)
    mlp = hf.DeepseekV4MLP(_hf_config())
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.copy_(_randn(g, *lin.weight.shape, std=0.3))
    x = _randn(g, T, D)
    gate, up = x @ mlp.gate_proj.weight.t(), x @ mlp.up_proj.weight.t()
    assert (gate > LIMIT).float().mean() > 0.1 and (up.abs() > LIMIT).float().mean() > 0.1
    out = swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, swiglu_limit=LIMIT)
    assert_rel_close(out, mlp(x), TOL, "shared mlp")
    unclamped = swiglu_mlp(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, swiglu_limit=None)
    assert (unclamped - out).abs().max() > 1e-2


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash_moe", "topk_moe"])
@torch.no_grad()
def test_sparse_moe_block_matches_transformers(layer_idx):
    g = _gen(5 + layer_idx)
    moe = hf.DeepseekV4SparseMoeBlock(_hf_config(), layer_idx)
    _fill_moe(moe, g)
    x = _randn(g, B, S, D)
    ids = torch.randint(0, V, (B, S), generator=g)
    expected = moe(x, input_ids=ids)

    xf = x.reshape(T, D)
    logits = xf.float() @ moe.gate.weight.float().t()
    if layer_idx == 0:
        w, idx = moe_route_hash(logits, moe.gate.tid2eid, ids.reshape(-1), route_scale=SCALE)
    else:
        w, idx = moe_route_topk(logits, moe.gate.e_score_correction_bias, K, route_scale=SCALE)
    sh = moe.shared_experts
    out = moe_experts(xf, idx, w, moe.experts.gate_up_proj, moe.experts.down_proj, swiglu_limit=LIMIT)
    out = out + swiglu_mlp(xf, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, swiglu_limit=LIMIT)
    assert_rel_close(out, expected.reshape(T, D), TOL, "moe block")


@torch.no_grad()
def test_experts_equal_dense_formula_weight_before_w2():
    """Brute force over all experts, routing weight applied to h before the down projection."""
    g = _gen(7)
    w13, w2 = _randn(g, E, 2 * I, D, std=0.3), _randn(g, E, D, I, std=0.3)
    x = _randn(g, T, D)
    w, idx = moe_route_topk(_randn(g, T, E), _randn(g, E), 3, route_scale=SCALE)
    dense = torch.zeros(T, D)
    for t in range(T):
        for i in range(3):
            e = int(idx[t, i])
            gate = (w13[e, :I] @ x[t]).clamp(max=LIMIT)
            up = (w13[e, I:] @ x[t]).clamp(-LIMIT, LIMIT)
            dense[t] += w2[e] @ (w[t, i] * F.silu(gate) * up)
    assert_rel_close(moe_experts(x, idx, w, w13, w2, swiglu_limit=LIMIT), dense, TOL, "dense")


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_weights_formula_and_sum(scoring):
    g = _gen(8)
    logits, bias = _randn(g, T, E, std=2.0), _randn(g, E)
    w, idx = moe_route_topk(logits, bias, K, route_scale=SCALE, scoring=scoring)
    assert_rel_close(w.sum(-1), torch.full((T,), SCALE), 1e-6, "sum")
    scores = {
        "sqrtsoftplus": torch.sqrt(torch.log1p(torch.exp(logits))),
        "sigmoid": 1 / (1 + torch.exp(-logits)),
        "softmax": torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True),
    }[scoring]
    picked = scores.gather(1, idx)
    assert_rel_close(w, SCALE * picked / picked.sum(-1, keepdim=True), TOL, "normalised")
    raw, raw_idx = moe_route_topk(logits, bias, K, route_scale=SCALE, scoring=scoring, norm_topk=False)
    assert torch.equal(raw_idx, idx)
    assert_rel_close(raw, SCALE * picked, TOL, "unnormalised")


def test_bias_changes_selection_not_weight_formula():
    g = _gen(9)
    logits = _randn(g, T, E)
    bias = torch.zeros(E)
    bias[[1, 6]] = 10.0  # forces experts 1 and 6 into every selection
    w0, idx0 = moe_route_topk(logits, None, K, route_scale=SCALE)
    w1, idx1 = moe_route_topk(logits, bias, K, route_scale=SCALE)
    assert torch.equal(idx1.sort(-1).values, torch.tensor([1, 6]).expand(T, K))
    assert not torch.equal(idx0.sort(-1).values, idx1.sort(-1).values)
    scores = F.softplus(logits).sqrt()
    picked = scores.gather(1, idx1)  # the bias (10) must not leak into the weights
    assert_rel_close(w1, SCALE * picked / picked.sum(-1, keepdim=True), TOL, "biased weights")
    # hash routing onto the same selection gives the same weights: selection bias never enters
    wh, idxh = moe_route_hash(logits, idx1.clone(), torch.arange(T), route_scale=SCALE)  # table row t = pick t
    assert torch.equal(idxh, idx1)
    assert_rel_close(wh, w1, 1e-7, "hash vs topk weights")


def test_hash_routing_ignores_scores_for_selection():
    g = _gen(10)
    table = _tid2eid(g)
    ids = torch.randint(0, V, (T,), generator=g)
    logits = _randn(g, T, E)
    _, idx_a = moe_route_hash(logits, table, ids, route_scale=SCALE)
    _, idx_b = moe_route_hash(logits + 100 * torch.eye(E)[3], table, ids, route_scale=SCALE)
    assert torch.equal(idx_a, table[ids]) and torch.equal(idx_b, table[ids])


def test_hash_routing_range_checks_can_be_skipped():
    g = _gen(11)
    table = _tid2eid(g)
    ids = torch.randint(0, V, (T,), generator=g)
    logits = _randn(g, T, E)
    want = moe_route_hash(logits, table, ids, route_scale=SCALE)
    got = moe_route_hash(logits, table, ids, route_scale=SCALE, check_ranges=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    bad = table.clone()
    bad[ids[0], 0] = E  # an expert id past the router's
    with pytest.raises(ValueError, match="tid2eid gives experts"):
        moe_route_hash(logits, bad, ids, route_scale=SCALE)
    with pytest.raises(ValueError, match="token ids span"):
        moe_route_hash(logits, table, ids + V, route_scale=SCALE)


def test_swiglu_clamp_is_asymmetric():
    gate = torch.tensor([-20.0, -1.0, 0.5, 20.0])
    up = torch.tensor([-20.0, 20.0, 0.5, 3.0])
    out = swiglu_clamp(gate, up, 10.0)
    expected = torch.tensor(
        [
            F.silu(torch.tensor(-20.0)) * -10.0,
            F.silu(torch.tensor(-1.0)) * 10.0,
            F.silu(torch.tensor(0.5)) * 0.5,
            F.silu(torch.tensor(10.0)) * 3.0,
        ]
    )
    assert_rel_close(out, expected, 1e-6, "clamped")
    assert_rel_close(swiglu_clamp(gate, up, None), F.silu(gate) * up, 1e-6, "unclamped")
    assert swiglu_clamp(gate.bfloat16(), up.bfloat16(), 10.0).dtype == torch.float32
    assert_bitwise(swiglu_clamp(gate, up, 10.0, torch.bfloat16), out.bfloat16(), "rounded to out_dtype")
    with pytest.raises(ValueError, match="out_dtype"):
        swiglu_clamp(gate, up, 10.0, torch.int32)


def test_dtypes_and_empty():
    g = _gen(11)
    w13, w2 = _randn(g, E, 2 * I, D, std=0.3), _randn(g, E, D, I, std=0.3)
    x = _randn(g, T, D)
    w, idx = moe_route_topk(_randn(g, T, E), None, K, route_scale=SCALE)
    out16 = moe_experts(x.bfloat16(), idx, w, w13.bfloat16(), w2.bfloat16(), swiglu_limit=LIMIT)
    assert out16.dtype == torch.bfloat16
    ref = moe_experts(x.bfloat16().float(), idx, w, w13.bfloat16().float(), w2.bfloat16().float(), swiglu_limit=LIMIT)
    assert_rel_close(out16, ref, 1e-2, "bf16 experts")
    assert moe_experts(x[:0], idx[:0], w[:0], w13, w2, swiglu_limit=LIMIT).shape == (0, D)
    we, ie = moe_route_topk(torch.zeros(0, E), None, K, route_scale=SCALE)
    assert we.shape == ie.shape == (0, K)


def test_errors():
    g = _gen(12)
    w13, w2 = _randn(g, E, 2 * I, D), _randn(g, E, D, I)
    x, w = _randn(g, 4, D), torch.ones(4, K)
    for bad in (E, -1):
        idx = torch.zeros(4, K, dtype=torch.long)
        idx[2, 1] = bad
        with pytest.raises(ValueError, match="expert ids"):
            moe_experts(x, idx, w, w13, w2, swiglu_limit=LIMIT)
    with pytest.raises(ValueError, match="scoring"):
        moe_route_topk(_randn(g, 4, E), None, K, route_scale=SCALE, scoring="relu")
    with pytest.raises(ValueError, match="scoring"):
        moe_route_hash(
            _randn(g, 4, E), _tid2eid(g), torch.zeros(4, dtype=torch.long), route_scale=SCALE, scoring="tanh"
        )
    with pytest.raises(ValueError):
        moe_route_topk(_randn(g, 4, E), None, E + 1, route_scale=SCALE)
    with pytest.raises(ValueError):
        moe_route_hash(_randn(g, 4, E), _tid2eid(g), torch.full((4,), V), route_scale=SCALE)
    with pytest.raises(ValueError):
        moe_route_hash(_randn(g, 4, E), _tid2eid(g, e=E + 3), torch.arange(4), route_scale=SCALE)
    with pytest.raises(ValueError):
        moe_experts(x, torch.zeros(4, K, dtype=torch.long), w, w13, w2[:, :, :-1], swiglu_limit=LIMIT)

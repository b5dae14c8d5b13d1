"""mHC ops against transformers' DeepSeek-V4 modules (fp32 oracle) and spec properties."""

import pytest
import torch
from deepinfer_kernels.ops.mhc import (
    MhcConfig,
    MhcParams,
    mhc_coefficients,
    mhc_collapse,
    mhc_collapse_rms_norm,
    mhc_expand,
    mhc_expand_collapse,
    mhc_head_weights,
    mhc_initial_pre_mix,
    mhc_lagged_layer,
    mhc_lagged_site,
    mhc_pre_collapse_rms_norm,
    mhc_same_site_sublayer,
)
from deepinfer_kernels.ops.moe import moe_experts, moe_route_hash, moe_route_topk, swiglu_mlp
from deepinfer_kernels.ops.rms_norm import rms_norm
from deepinfer_kernels.registry import list_ops
from deepinfer_kernels.testing.compare import assert_rel_close, rel_err
from torch import nn

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

TOL = 1e-5
N, D = 4, 64
B, S = 3, 5
T = B * S

# (hc_eps, norm_eps, sinkhorn_iters): the real values, and exaggerated epsilons so a misplaced
# epsilon moves the result far more than the tolerance.
EPS_CASES = [(1e-6, 1e-6, 20), (0.05, 0.5, 3), (1e-6, 1e-20, 1)]


def _hf_config(hc_eps=1e-6, norm_eps=1e-6, iters=20, **kw) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        vocab_size=100,
        hidden_size=D,
        moe_intermediate_size=32,
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
        n_routed_experts=8,
        num_experts_per_tok=2,
        hc_mult=N,
        hc_eps=hc_eps,
        hc_sinkhorn_iters=iters,
        rms_norm_eps=norm_eps,
        swiglu_limit=2.0,
        layer_types=["sliding_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe"],
        **kw,
    )
    cfg._experts_implementation = "eager"
    return cfg


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, std=1.0):
    return torch.randn(*shape, generator=g) * std


@torch.no_grad()
def _fill_hc(module: nn.Module, g: torch.Generator, fn_std: float = 0.1) -> None:
    """Random non-trivial fn / base / scale on a HyperConnection or HyperHead."""
    for name, p in module.named_parameters():
        if name.endswith("fn"):
            p.copy_(_randn(g, *p.shape, std=fn_std))
        elif name.endswith("base"):
            p.copy_(_randn(g, *p.shape, std=0.5))
        elif name.endswith("scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:
            raise AssertionError(f"unexpected mHC parameter {name}")


def _params(hc) -> MhcParams:
    return MhcParams(fn=hc.fn.detach().clone(), base=hc.base.detach().clone(), scale=hc.scale.detach().clone())


def _random_params(g, fn_std=0.1) -> MhcParams:
    rows = (2 + N) * N
    return MhcParams(
        fn=_randn(g, rows, N * D, std=fn_std),
        base=_randn(g, rows, std=0.5),
        scale=0.5 + torch.rand(3, generator=g),
    )


def _cfg(hc_eps=1e-6, norm_eps=1e-6, iters=20) -> MhcConfig:
    return MhcConfig(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=iters)


def test_references_registered():
    ops = list_ops()
    names = ("mhc_coefficients", "mhc_collapse", "mhc_collapse_rms_norm", "mhc_expand", "mhc_head_weights")
    for name in (*names, "mhc_pre_collapse_rms_norm"):
        assert name in ops


@pytest.mark.parametrize("hc_eps,norm_eps,iters", EPS_CASES)
@torch.no_grad()
def test_coefficients_and_collapse_match_transformers(hc_eps, norm_eps, iters):
    g = _gen(1)
    hc = hf.DeepseekV4HyperConnection(_hf_config(hc_eps, norm_eps, iters))
    _fill_hc(hc, g)
    x = _randn(g, B, S, N, D)
    post_ref, comb_ref, collapsed_ref = hc(x)

    pre, post, comb = mhc_coefficients(x.reshape(T, N, D), _params(hc), _cfg(hc_eps, norm_eps, iters))
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert_rel_close(post, post_ref.reshape(T, N), TOL, "post")
    assert_rel_close(comb, comb_ref.reshape(T, N, N), TOL, "comb")
    assert_rel_close(mhc_collapse(x.reshape(T, N, D), pre), collapsed_ref.reshape(T, D), TOL, "collapsed")
    # pre itself: the oracle only exposes it through the collapse, which is linear in pre with
    # d = 64 > n = 4 equations per token, so recover it by least squares in float64
    sol = torch.linalg.lstsq(x.reshape(T, N, D).transpose(1, 2).double(), collapsed_ref.reshape(T, D, 1).double())
    assert_rel_close(pre, sol.solution.squeeze(-1), 1e-4, "pre")


@pytest.mark.parametrize("hc_eps,norm_eps,iters", EPS_CASES[:2])
@torch.no_grad()
def test_mixing_formula_matches_transformers_decoder_expression(hc_eps, norm_eps, iters):
    """post*y + comb^T x exactly as DeepseekV4DecoderLayer writes it, with a random y."""
    g = _gen(2)
    hc = hf.DeepseekV4HyperConnection(_hf_config(hc_eps, norm_eps, iters))
    _fill_hc(hc, g)
    x = _randn(g, B, S, N, D)
    y = _randn(g, B, S, D)
    post_ref, comb_ref, _ = hc(x)
    expected = post_ref.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb_ref.transpose(-1, -2), x)

    _, post, comb = mhc_coefficients(x.reshape(T, N, D), _params(hc), _cfg(hc_eps, norm_eps, iters))
    out = mhc_expand(x.reshape(T, N, D), y.reshape(T, D), post, comb)
    assert_rel_close(out, expected.reshape(T, N, D), TOL, "expand")
    # contracting the wrong comb index must be detectably wrong (comb is not symmetric)
    wrong = post.unsqueeze(-1) * y.reshape(T, 1, D) + torch.matmul(comb, x.reshape(T, N, D))
    assert rel_err(wrong, expected.reshape(T, N, D)) > 1e-3


class _StubAttention(nn.Module):
    """Stands in for DeepseekV4Attention inside the oracle decoder layer: y = tanh(u W^T)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, hidden_states, **kwargs):
        return torch.tanh(hidden_states @ self.w.t()), None


@torch.no_grad()
def _fill_layer(layer: nn.Module, g: torch.Generator) -> None:
    _fill_hc(layer.attn_hc, g)
    _fill_hc(layer.ffn_hc, g)
    layer.input_layernorm.weight.copy_(1 + _randn(g, D, std=0.2))
    layer.post_attention_layernorm.weight.copy_(1 + _randn(g, D, std=0.2))
    moe = layer.mlp
    moe.gate.weight.copy_(_randn(g, *moe.gate.weight.shape, std=0.3))
    if moe.is_hash:
        e, k = moe.gate.num_experts, moe.gate.top_k
        moe.gate.tid2eid.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(100)]))
    else:
        moe.gate.e_score_correction_bias.copy_(_randn(g, moe.gate.num_experts, std=0.3))
    moe.experts.gate_up_proj.copy_(_randn(g, *moe.experts.gate_up_proj.shape, std=0.3))
    moe.experts.down_proj.copy_(_randn(g, *moe.experts.down_proj.shape, std=0.3))
    for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj, moe.shared_experts.down_proj):
        lin.weight.copy_(_randn(g, *lin.weight.shape, std=0.3))


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash_moe", "topk_moe"])
@torch.no_grad()
def test_v4_decoder_layer_matches_transformers(layer_idx):
    """Whole V4 block (attention replaced by a stub, real MoE) through the same-site wiring."""
    g = _gen(3 + layer_idx)
    hf_cfg = _hf_config()
    layer = hf.DeepseekV4DecoderLayer(hf_cfg, layer_idx=layer_idx)
    _fill_layer(layer, g)
    w_attn = _randn(g, D, D, std=0.2)
    layer.self_attn = _StubAttention(w_attn)
    x = _randn(g, B, S, N, D)
    ids = torch.randint(0, 100, (B, S), generator=g)
    expected = layer(x, input_ids=ids)

    cfg = _cfg(hf_cfg.hc_eps, hf_cfg.rms_norm_eps, hf_cfg.hc_sinkhorn_iters)
    eps = hf_cfg.rms_norm_eps
    moe = layer.mlp

    def f_attn(u):
        return torch.tanh(rms_norm(u, layer.input_layernorm.weight, eps) @ w_attn.t())

    def f_ffn(u):
        h = rms_norm(u, layer.post_attention_layernorm.weight, eps)
        logits = h.float() @ moe.gate.weight.float().t()
        if moe.is_hash:
            w, e = moe_route_hash(logits, moe.gate.tid2eid, ids.reshape(-1), route_scale=hf_cfg.routed_scaling_factor)
        else:
            w, e = moe_route_topk(logits, moe.gate.e_score_correction_bias, 2, route_scale=hf_cfg.routed_scaling_factor)
        routed = moe_experts(h, e, w, moe.experts.gate_up_proj, moe.experts.down_proj, swiglu_limit=2.0)
        sh = moe.shared_experts
        return routed + swiglu_mlp(h, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, swiglu_limit=2.0)

    xf = x.reshape(T, N, D)
    x1 = mhc_same_site_sublayer(xf, f_attn, _params(layer.attn_hc), cfg)
    out = mhc_same_site_sublayer(x1, f_ffn, _params(layer.ffn_hc), cfg)
    assert_rel_close(out, expected.reshape(T, N, D), TOL, "decoder layer")


@pytest.mark.parametrize("hc_eps,norm_eps", [(1e-6, 1e-6), (0.05, 0.5)])
@torch.no_grad()
def test_hc_head_matches_transformers(hc_eps, norm_eps):
    g = _gen(5)
    head = hf.DeepseekV4HyperHead(_hf_config(hc_eps, norm_eps))
    _fill_hc(head, g)
    x = _randn(g, B, S, N, D)
    expected = head(x)
    pre = mhc_head_weights(
        x.reshape(T, N, D), head.hc_fn, head.hc_base, head.hc_scale, norm_eps=norm_eps, hc_eps=hc_eps
    )
    assert pre.shape == (T, N) and pre.dtype == torch.float32
    assert_rel_close(mhc_collapse(x.reshape(T, N, D), pre), expected.reshape(T, D), TOL, "hc_head")


@torch.no_grad()
def test_comb_is_doubly_stochastic_and_not_symmetric():
    g = _gen(6)
    x = _randn(g, 64, N, D)
    # comb logits with std ~1 (far from uniform, yet well inside Sinkhorn's fast-converging range;
    # very peaked softmax rows can need more than 20 passes)
    params = _random_params(g, fn_std=0.05)
    _, _, comb = mhc_coefficients(x, params, _cfg(iters=20))
    assert comb.amax(-1).mean() > 0.35 and comb.amin(-1).mean() < 0.2
    assert (comb.sum(-1) - 1).abs().max() < 1e-3, "rows"
    assert (comb.sum(-2) - 1).abs().max() < 1e-3, "columns"
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-2
    # one iteration = softmax rows, then a single column pass: columns exact, rows not yet
    _, _, comb1 = mhc_coefficients(x, params, _cfg(iters=1))
    assert (comb1.sum(-2) - 1).abs().max() < 1e-4
    assert (comb1.sum(-1) - 1).abs().max() > 1e-2


def _coeffs_unrolled(x, params: MhcParams, cfg: MhcConfig):
    """Independent per-entry transcription of spec A.3.1 (loops, no reshapes of comb)."""
    t = x.shape[0]
    flat = torch.cat([x[:, j] for j in range(N)], dim=-1).float()
    r = 1.0 / torch.sqrt((flat * flat).mean(-1) + cfg.norm_eps)
    m = r[:, None] * torch.einsum("tc,rc->tr", flat, params.fn)
    b, s = params.base, params.scale
    pre = torch.stack([torch.sigmoid(s[0] * m[:, j] + b[j]) + cfg.hc_eps for j in range(N)], -1)
    post = torch.stack([2 * torch.sigmoid(s[1] * m[:, N + k] + b[N + k]) for k in range(N)], -1)
    c = torch.empty(t, N, N)
    for j in range(N):
        row = torch.stack([s[2] * m[:, 2 * N + j * N + k] + b[2 * N + j * N + k] for k in range(N)], -1)
        c[:, j] = torch.softmax(row, -1) + cfg.hc_eps
    c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def _collapse_unrolled(x, w):
    return sum(w[:, j : j + 1] * x[:, j] for j in range(N))


def _expand_unrolled(x, y, post, c):
    return torch.stack(
        [post[:, k : k + 1] * y + sum(c[:, j, k : k + 1] * x[:, j] for j in range(N)) for k in range(N)], 1
    )


@torch.no_grad()
def test_unrolled_coefficients_agree_with_transformers():
    """Anchors the hand-written transcription used by the lagged-wiring test."""
    g = _gen(7)
    hc = hf.DeepseekV4HyperConnection(_hf_config(0.05, 0.5, 3))
    _fill_hc(hc, g)
    x = _randn(g, B, S, N, D)
    post_ref, comb_ref, collapsed_ref = hc(x)
    pre, post, comb = _coeffs_unrolled(x.reshape(T, N, D), _params(hc), _cfg(0.05, 0.5, 3))
    assert_rel_close(post, post_ref.reshape(T, N), TOL, "post")
    assert_rel_close(comb, comb_ref.reshape(T, N, N), TOL, "comb")
    assert_rel_close(_collapse_unrolled(x.reshape(T, N, D), pre), collapsed_ref.reshape(T, D), TOL, "collapse")


@torch.no_grad()
def test_lagged_layer_equals_unrolled_spec_b2_and_differs_from_same_site():
    g = _gen(8)
    cfg = _cfg(1e-6, 1e-20, 20)  # V4.1 epsilons
    layers = [(_random_params(g), _random_params(g), _randn(g, D, D, std=0.2), _randn(g, D, D, std=0.2))]
    layers.append((_random_params(g), _random_params(g), _randn(g, D, D, std=0.2), _randn(g, D, D, std=0.2)))
    e = _randn(g, T, D)
    x0 = e[:, None].expand(T, N, D).contiguous()  # 4 identical copies of the embedding

    # ours: two V4.1 blocks then the final collapse with the returned pre_mix
    x, pre_mix = x0, mhc_initial_pre_mix(T, N)
    assert torch.equal(pre_mix, torch.eye(N)[0].expand(T, N))
    for pa, pf, wa, wf in layers:
        x, pre_mix = mhc_lagged_layer(
            x,
            pre_mix,
            lambda u, w=wa: torch.tanh(u @ w.t()),
            lambda u, w=wf: torch.sin(u @ w.t()),
            pa,
            pf,
            cfg,
        )
    h = mhc_collapse(x, pre_mix)

    # hand-unrolled spec B.2
    xu, mix = x0, torch.zeros(T, N)
    mix[:, 0] = 1
    for pa, pf, wa, wf in layers:
        p_a, q_a, c_a = _coeffs_unrolled(xu, pa, cfg)
        y = torch.tanh(_collapse_unrolled(xu, mix) @ wa.t())
        x1 = _expand_unrolled(xu, y, q_a, c_a)
        p_f, q_f, c_f = _coeffs_unrolled(x1, pf, cfg)
        y2 = torch.sin(_collapse_unrolled(x1, p_a) @ wf.t())
        xu, mix = _expand_unrolled(x1, y2, q_f, c_f), p_f
    hu = _collapse_unrolled(xu, mix)
    assert_rel_close(x, xu, TOL, "streams")
    assert_rel_close(pre_mix, mix, TOL, "pre_mix")
    assert_rel_close(h, hu, TOL, "final hidden")

    # V4 same-site wiring with the same parameters is a different function
    xs = x0
    for pa, pf, wa, wf in layers:
        xs = mhc_same_site_sublayer(xs, lambda u, w=wa: torch.tanh(u @ w.t()), pa, cfg)
        xs = mhc_same_site_sublayer(xs, lambda u, w=wf: torch.sin(u @ w.t()), pf, cfg)
    assert rel_err(xs, x) > 1e-2


@torch.no_grad()
def test_bf16_streams_keep_dtype_and_track_fp32():
    g = _gen(9)
    params, cfg = _random_params(g), _cfg()
    x32 = _randn(g, T, N, D)
    x16 = x32.bfloat16()
    pre, post, comb = mhc_coefficients(x16, params, cfg)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    y = _randn(g, T, D).bfloat16()
    u = mhc_collapse(x16, pre)
    out = mhc_expand(x16, y, post, comb)
    assert u.dtype == out.dtype == torch.bfloat16
    pre32, post32, comb32 = mhc_coefficients(x16.float(), params, cfg)
    assert_rel_close(u, mhc_collapse(x16.float(), pre32), 1e-2, "collapse bf16")
    assert_rel_close(out, mhc_expand(x16.float(), y.float(), post32, comb32), 1e-2, "expand bf16")


@torch.no_grad()
def test_collapse_rms_norm_is_the_two_ops_and_the_sublayers_norm_argument():
    g = _gen(11)
    params, cfg = _random_params(g), _cfg()
    x = _randn(g, T, N, D).bfloat16()
    w, gain = torch.rand(T, N, generator=g) + 0.1, torch.rand(D, generator=g) + 0.5
    fused = mhc_collapse_rms_norm(x, w, gain, 1e-6)
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, rms_norm(mhc_collapse(x, w), gain, 1e-6))

    def f(u):
        return torch.tanh(u.float()).to(u.dtype)

    same = mhc_same_site_sublayer(x, lambda u: f(rms_norm(u, gain, 1e-6)), params, cfg)
    assert torch.equal(mhc_same_site_sublayer(x, f, params, cfg, norm=(gain, 1e-6)), same)
    lagged, p = mhc_lagged_site(x, w, lambda u: f(rms_norm(u, gain, 1e-6)), params, cfg)
    lagged_n, p_n = mhc_lagged_site(x, w, f, params, cfg, norm=(gain, 1e-6))
    assert torch.equal(lagged_n, lagged) and torch.equal(p_n, p)
    with pytest.raises(ValueError, match="norm_weight"):
        mhc_collapse_rms_norm(x, w, gain[:-1], 1e-6)
    with pytest.raises(ValueError, match="weights"):
        mhc_collapse_rms_norm(x, w[:, :-1], gain, 1e-6)


@torch.no_grad()
def test_pre_collapse_rms_norm_is_the_site_pre_then_collapse_and_norm():
    """A V4 site's sublayer input from its pre rows alone: the coefficients' pre (fn / base rows 0..n-1, the pre
    scale), then the collapse + norm; exaggerated epsilons, fp32 and bf16 streams."""
    g = _gen(13)
    params = _random_params(g)
    gain = torch.rand(D, generator=g) + 0.5
    for hc_eps, norm_eps, iters in EPS_CASES:
        cfg = _cfg(hc_eps, norm_eps, iters)
        for dtype in (torch.float32, torch.bfloat16):
            x = _randn(g, T, N, D).to(dtype)
            pre, _, _ = mhc_coefficients(x, params, cfg)
            want = mhc_collapse_rms_norm(x, pre, gain, 1e-6)
            got = mhc_pre_collapse_rms_norm(
                x, params.fn[:N], params.base[:N], params.scale[:1], gain, norm_eps=norm_eps, hc_eps=hc_eps, eps=1e-6
            )
            assert got.dtype == dtype
            # the reference mixes of 4 fn rows and of 24 round differently (tiled linear_ref): fp32 rounding apart
            assert_rel_close(got, want, TOL if dtype == torch.float32 else 4e-3, f"{dtype} {(hc_eps, norm_eps, iters)}")
    x = _randn(g, T, N, D)
    args = (params.fn[:N], params.base[:N], params.scale[:1], gain)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, eps=1e-6)
    with pytest.raises(ValueError, match="fn"):
        mhc_pre_collapse_rms_norm(x, params.fn, *args[1:], **kw)
    with pytest.raises(ValueError, match="base"):
        mhc_pre_collapse_rms_norm(x, args[0], params.base, *args[2:], **kw)
    with pytest.raises(ValueError, match="scale"):
        mhc_pre_collapse_rms_norm(x, *args[:2], params.scale, gain, **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        mhc_pre_collapse_rms_norm(x, *args[:3], gain[:-1], **kw)
    assert mhc_pre_collapse_rms_norm(x[:0], *args, **kw).shape == (0, D)


def test_sublayer_output_as_two_addends():
    """A sublayer may return (y, y_add) (a MoE's routed and shared experts): the expand adds them in y's dtype,
    the same bits as expanding y + y_add, at both site kinds."""
    g = _gen(12)
    params, cfg = _random_params(g), _cfg()
    x = _randn(g, T, N, D).bfloat16()
    w = torch.rand(T, N, generator=g) + 0.1
    a, b = _randn(g, T, D).bfloat16(), _randn(g, T, D).bfloat16()
    _, post, comb = mhc_coefficients(x, params, cfg)
    assert torch.equal(mhc_expand(x, a, post, comb, y_add=b), mhc_expand(x, a + b, post, comb))
    assert torch.equal(
        mhc_same_site_sublayer(x, lambda u: (a * u, b), params, cfg),
        mhc_same_site_sublayer(x, lambda u: a * u + b, params, cfg),
    )
    pair, p = mhc_lagged_site(x, w, lambda u: (a * u, b), params, cfg)
    one, p1 = mhc_lagged_site(x, w, lambda u: a * u + b, params, cfg)
    assert torch.equal(pair, one) and torch.equal(p, p1)
    with pytest.raises(ValueError, match="y_add"):
        mhc_expand(x, a, post, comb, y_add=b.float())
    with pytest.raises(ValueError, match="y_add"):
        mhc_expand(x, a, post, comb, y_add=b[:-1])


def test_expand_collapse_is_the_expand_then_the_collapse():
    """V4.1's lagged wiring collapses a site's new streams with its own pre (the next site's weights), so the
    expand can hand that collapse over too: the same bits as the two ops in a row, y_add and empty calls included,
    and the same shape checks as ``mhc_expand`` plus the weights'."""
    g = _gen(13)
    params, cfg = _random_params(g), _cfg()
    for dtype in (torch.float32, torch.bfloat16):
        x = _randn(g, T, N, D).to(dtype)
        a, b = _randn(g, T, D).to(dtype), _randn(g, T, D).to(dtype)
        pre, post, comb = mhc_coefficients(x, params, cfg)
        for y_add in (None, b):
            out, u = mhc_expand_collapse(x, a, post, comb, pre, y_add=y_add)
            want = mhc_expand(x, a, post, comb, y_add=y_add)
            assert torch.equal(out, want) and torch.equal(u, mhc_collapse(want, pre))
            assert out.dtype == u.dtype == dtype and u.shape == (T, D)
    out, u = mhc_expand_collapse(x[:0], a[:0], post[:0], comb[:0], pre[:0])
    assert out.shape == (0, N, D) and u.shape == (0, D)
    with pytest.raises(ValueError, match="weights"):
        mhc_expand_collapse(x, a, post, comb, pre[:, :-1])
    with pytest.raises(ValueError, match="post"):
        mhc_expand_collapse(x, a, post[:-1], comb, pre)
    with pytest.raises(ValueError, match="y_add"):
        mhc_expand_collapse(x, a, post, comb, pre, y_add=b.float())


def test_empty_and_bad_shapes():
    g = _gen(10)
    params, cfg = _random_params(g), _cfg()
    x = torch.zeros(0, N, D)
    pre, post, comb = mhc_coefficients(x, params, cfg)
    assert pre.shape == (0, N) and post.shape == (0, N) and comb.shape == (0, N, N)
    assert mhc_collapse(x, pre).shape == (0, D)
    assert mhc_expand(x, torch.zeros(0, D), post, comb).shape == (0, N, D)
    with pytest.raises(ValueError):
        mhc_coefficients(torch.zeros(2, N, D + 1), params, cfg)
    with pytest.raises(ValueError):
        mhc_coefficients(torch.zeros(2, N * D), params, cfg)
    with pytest.raises(ValueError):
        mhc_collapse(torch.zeros(2, N, D), torch.zeros(2, N + 1))
    with pytest.raises(ValueError):
        mhc_expand(torch.zeros(2, N, D), torch.zeros(2, D), torch.zeros(2, N), torch.zeros(2, N))
    with pytest.raises(ValueError):
        mhc_coefficients(torch.zeros(2, N, D), params, _cfg(iters=0))

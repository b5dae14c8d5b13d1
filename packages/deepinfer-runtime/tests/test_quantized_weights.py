"""Weights kept quantised inside the models (layers.quantize_weights_): FP8 / MXFP8 block-scaled Linears through
act_quant_fp8 + fp8_gemm_nt, MXFP4 experts through the MXFP4 grouped-GEMM ops, against today's dequantised path."""

import copy

import pytest
import torch
from deepinfer_kernels import (
    Mxfp4Experts,
    act_quant_fp8,
    fp8_block_dequantize,
    fp8_gemm_nt,
    moe_experts,
    moe_route_topk,
    swiglu_clamp,
    swiglu_mlp,
)
from deepinfer_kernels.ops import moe as moe_ops
from deepinfer_kernels.registry import set_batch_invariant
from deepinfer_runtime.models import layers
from deepinfer_runtime.models.layers import Experts, Linear, SharedExpert, project, quantize_weights_
from deepinfer_runtime.testing import model_slice as ms

V41_TINY = dict(
    hidden_size=128, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=64, o_groups=4,
    o_lora_rank=32, n_routed_experts=16, moe_intermediate_size=64, index_n_heads=16, index_head_dim=64, index_topk=8,
    sliding_window=16, candidate_topk_blocks=4, candidate_block_size=4, engram_head_dim=64, vocab_size=4096,
)  # fmt: skip


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_gemm_op_and_close_to_the_dequantised_path(block, dtype):
    g = torch.Generator().manual_seed(block)
    lin = Linear(256, 200, dtype)
    lin.weight.data.copy_(torch.randn(200, 256, generator=g) / 16)
    x = torch.randn(3, 5, 256, generator=g).to(dtype)
    before = lin(x).float()
    lin.quantize_fp8_(block)
    assert "weight" not in dict(lin.named_parameters()) and lin.qweight.dtype == torch.float8_e4m3fn
    assert lin.scale.shape == (-(-200 // block), 256 // block)
    w = fp8_block_dequantize(lin.qweight, lin.scale, (block, block), out_dtype=dtype)
    assert torch.equal(lin.weight, w)  # direct readers get the dequantised matrix
    y = lin(x)
    a, s = act_quant_fp8(x.reshape(-1, 256), block)
    assert torch.equal(y.reshape(-1, 200), fp8_gemm_nt(a, s, lin.qweight, lin.scale, block, out_dtype=dtype))
    assert y.shape == (3, 5, 200) and y.dtype == dtype
    assert rel(y.float(), before) < 0.06  # weight + per-(1 x block) activation quantisation
    assert lin(x[:0]).shape == (0, 5, 200)


def test_project_mixes_fp8_and_plain_linears():
    """``project`` (a decode step's projections of one input): FP8 Linears asked for x's dtype run their own GEMM,
    the others (and an FP8 one asked for fp32, through its dequantised weight) are exactly ``linear`` each."""
    from deepinfer_kernels import linear

    torch.manual_seed(0)
    lins = [Linear(256, n, torch.bfloat16) for n in (64, 32, 48)]
    for m in lins:
        m.weight.data.normal_(0, 0.05)
    lins[0].quantize_fp8_(128)
    x = torch.randn(3, 256).to(torch.bfloat16)
    f32 = torch.float32
    a, b, c = project(x, lins, [None, None, f32])
    assert torch.equal(a, lins[0](x)) and torch.equal(b, linear(x, lins[1].weight))
    assert c.dtype == f32 and torch.equal(c, linear(x, lins[2].weight, out_dtype=f32))
    (d,) = project(x, lins[:1], [f32])
    assert d.dtype == f32 and torch.equal(d, linear(x, lins[0].weight, out_dtype=f32))


def test_project_quantises_x_once_per_fp8_block(monkeypatch):
    """FP8 Linears of one block size in one ``project`` call (a decode step's wq_a and wkv) share one activation
    quantisation of x, and each output is its own forward's, bitwise."""
    from deepinfer_runtime.models import layers

    torch.manual_seed(1)
    lins = [Linear(256, n, torch.bfloat16) for n in (64, 32, 48, 16)]
    for m in lins:
        m.weight.data.normal_(0, 0.05)
    for m, block in zip(lins, (128, 128, 32)):
        m.quantize_fp8_(block)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    want = [m(x) for m in lins]
    calls = []
    real = layers.quantize_fp8_activations
    monkeypatch.setattr(layers, "quantize_fp8_activations", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    got = project(x, lins, [None] * 4)
    assert sorted(calls) == [32, 128], "one quantisation per block size"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.equal(g, w), f"projection {i}"


def test_fp8_linear_refuses_a_k_not_multiple_of_the_block():
    with pytest.raises(ValueError, match="multiple"):
        Linear(48, 8, torch.float32).quantize_fp8_(32)


@pytest.mark.parametrize("experts_per_row", [10**9, 0])
def test_mxfp4_experts_match_the_dequantised_reference(experts_per_row, monkeypatch):
    # sorted (prefill) / gathered (decode) layout
    monkeypatch.setattr(moe_ops, "MXFP4_GATHER_EXPERTS_PER_ROW", experts_per_row)
    g = torch.Generator().manual_seed(1)
    e, inter, d, t, k = 16, 64, 128, 40, 6
    ex = Experts(e, inter, d, torch.float32)
    ex.w13.data.copy_(torch.randn(e, 2 * inter, d, generator=g) / d**0.5)
    ex.w2.data.copy_(torch.randn(e, d, inter, generator=g) / inter**0.5)
    ex.quantize_mxfp4_()
    assert ex.quantized and isinstance(ex.w13, Mxfp4Experts) and ex.w13.shape == (e, 2 * inter, d)
    assert ex.w13_packed.shape == (e, 2 * inter, d // 2) and ex.w2_scale.shape == (e, d, inter // 32)
    x = torch.randn(t, d, generator=g)
    w, ids = moe_route_topk(torch.randn(t, e, generator=g), None, k, route_scale=1.5)
    got = moe_experts(x, ids, w, ex.w13, ex.w2, swiglu_limit=10.0)
    want = moe_experts(x, ids, w, ex.w13.dequantize(), ex.w2.dequantize(), swiglu_limit=10.0)
    assert rel(got, want) < 1e-5  # same weights; only the order of each token's k additions differs
    with pytest.raises(ValueError, match="both"):
        moe_experts(x, ids, w, ex.w13, ex.w2.dequantize(), swiglu_limit=10.0)


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_shared_expert_is_three_fp8_linears(block):
    """``SharedExpert.quantize_fp8_``: gate and up stacked in one FP8 Linear give the bits of two FP8 Linears of the
    same weights (no scale tile spans the two), the SwiGLU rounded to x's dtype, the FP8 down Linear; within
    quantisation error of the bf16 MLP. An intermediate size that is not a multiple of the block is refused."""
    g = torch.Generator().manual_seed(block)
    inter, hidden = 256, 384
    se = SharedExpert(inter, hidden, torch.bfloat16)
    for lin in (se.w1, se.w3, se.w2):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
    x = torch.randn(9, hidden, generator=g).bfloat16()
    dense = se(x, 10.0)
    assert torch.equal(dense, swiglu_mlp(x, se.w1.weight, se.w3.weight, se.w2.weight, swiglu_limit=10.0))
    w1, w3, w2 = (copy.deepcopy(lin) for lin in (se.w1, se.w3, se.w2))
    for lin in (w1, w3, w2):
        lin.quantize_fp8_(block)
    se.quantize_fp8_(block)
    assert se.quantized and not hasattr(se, "w1") and se.w13.qweight.shape == (2 * inter, hidden)
    got = se(x, 10.0)
    want = w2(swiglu_clamp(w1(x), w3(x), 10.0, torch.bfloat16))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert rel(got.float(), dense.float()) < 0.1  # FP8 weights and activations: a few percent
    odd = SharedExpert(48, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        odd.quantize_fp8_(32)


def _tiny_v41(quant="none"):
    cfg = ms.v41_slice_config(engram_vocab_size=100, **V41_TINY)
    return ms.build_random_model(cfg, "cpu", torch.float32, quant=quant, yoco_mode="off", fake_quant=False)


def _run(model, ids, steps=3):
    cache = model.new_cache()
    out = [model.forward_step([ids], [cache])[0][-1:]]
    out += [model.forward_step([ids[i : i + 1]], [cache])[0] for i in range(steps)]
    return torch.cat(out)


IDS = torch.randint(3, 4000, (24,), generator=torch.Generator().manual_seed(0))


def test_model_with_mxfp4_experts_matches_the_dequantised_model():
    model = _tiny_v41()
    ref = copy.deepcopy(model)
    assert quantize_weights_(model, None, experts=True) == {"linear": 0, "experts": 8}
    for mq, mr in zip(model.modules(), ref.modules()):
        if isinstance(mq, Experts):
            mr.w13.data.copy_(mq.w13.dequantize())
            mr.w2.data.copy_(mq.w2.dequantize())
    assert rel(_run(model, IDS), _run(ref, IDS)) < 1e-4


def test_quantized_model_runs_under_forced_references_and_is_batch_invariant(monkeypatch):
    monkeypatch.setattr(layers, "QUANTIZE_SHARED_EXPERTS", True)  # the FP8 shared experts too
    model = _tiny_v41("fp8+fp4")
    kinds = {type(m.experts.w13).__name__ for m in model.modules() if hasattr(m, "experts")}
    assert kinds == {"Mxfp4Experts"}
    shared = model.layers[0].ffn.shared_experts
    assert model.layers[0].attn.wq_a.block == 32 and shared.quantized and shared.w13.block == shared.w2.block == 32
    base = _run(model, IDS)
    assert torch.isfinite(base).all()
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert torch.equal(_run(model, IDS), base)  # the CPU has only references: the switch changes nothing here
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE")
    set_batch_invariant(True)
    try:
        alone = _run(model, IDS, steps=0)
        others = [torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 90)]
        caches = [model.new_cache() for _ in range(3)]
        batched = model.forward_step([others[0], IDS, others[1]], caches)[1][-1:]
    finally:
        set_batch_invariant(None)
    assert torch.equal(alone, batched)

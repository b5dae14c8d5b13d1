"""moe_route_topk: the Triton router vs the reference under Triton's interpreter on CPU (every scoring, with and
without the selection bias and the normalisation, V4 / V4.1 / odd expert counts, very negative logits where a
naive softplus would tie, a NaN logit) and on CUDA at V4.1-Flash shapes (384 experts, top-6), where a token alone
also equals the same token among 4096, bitwise."""

import pytest
import torch
from deepinfer_kernels.ops.moe import moe_route_topk
from deepinfer_kernels.ops.moe.reference import moe_route_topk_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _logits(t: int, e: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(device), (torch.randn(e, generator=g) * 0.1).to(device)


def _same(logits, bias, k, what, **kw):
    from deepinfer_kernels.ops.moe.route_triton import moe_route_topk_triton

    w, e = moe_route_topk_triton(logits, bias, k, route_scale=1.5, **kw)
    w_ref, e_ref = moe_route_topk_ref(logits, bias, k, route_scale=1.5, **kw)
    assert e.dtype == torch.int64 and w.dtype == torch.float32, what
    assert torch.equal(e, e_ref), f"{what}: experts differ in {int((e != e_ref).any(1).sum())} rows"
    assert_rel_close(w, w_ref, 1e-5, what)


def _interp_matches_reference(e: int, k: int):
    logits, bias = _logits(37, e, seed=e + k)
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        for b in (None, bias):
            for norm in (True, False):
                _same(logits, b, k, f"E={e} k={k} {scoring} bias={b is not None} norm={norm}", scoring=scoring,
                      norm_topk=norm)  # fmt: skip
    # scores of logits near -30 differ only in their last digits: a softplus of log(1 + exp(x)) would make them 0
    _same(logits - 30, bias * 1e-6, k, f"E={e} k={k} very negative logits")
    strided = torch.cat([logits, logits], dim=1)[:, :e]  # rows with a stride of 2E
    _same(strided, bias, k, f"E={e} k={k} strided rows")


def _interp_nan():
    from deepinfer_kernels.ops.moe.route_triton import moe_route_topk_triton

    logits, bias = _logits(4, 64, seed=3)
    logits[1, 17] = float("nan")
    w, e = moe_route_topk_triton(logits, bias, 6, route_scale=1.5)
    w_ref, e_ref = moe_route_topk_ref(logits, bias, 6, route_scale=1.5)
    assert int(e[1, 0]) == int(e_ref[1, 0]) == 17 and torch.isnan(w[1]).all() and torch.isnan(w_ref[1]).all()
    assert torch.equal(e[[0, 2, 3]], e_ref[[0, 2, 3]])


INTERP_CASES = {
    "v4-256-top6": ("_interp_matches_reference", (256, 6)),
    "v41-384-top6": ("_interp_matches_reference", (384, 6)),
    "odd-20-top3": ("_interp_matches_reference", (20, 3)),
    "one-expert-top1": ("_interp_matches_reference", (1, 1)),
    "nan": ("_interp_nan", ()),
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
def test_gpu_v41_shapes_and_batch_invariance():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels import registry
    from deepinfer_kernels.ops.moe.route_triton import moe_route_topk_triton

    assert registry.resolve("moe_route_topk", "cuda") is moe_route_topk_triton
    logits, bias = _logits(4096, 384, seed=9, device="cuda")
    w, e = moe_route_topk(logits, bias, 6, route_scale=1.5)
    w_ref, e_ref = moe_route_topk_ref(logits, bias, 6, route_scale=1.5)
    assert torch.equal(e, e_ref)
    assert_rel_close(w, w_ref, 1e-5, "V4.1 router")
    for tok in (0, 100, 4095):
        w1, e1 = moe_route_topk(logits[tok : tok + 1], bias, 6, route_scale=1.5)
        assert_bitwise(w1, w[tok : tok + 1], f"token {tok} alone vs among 4096")
        assert torch.equal(e1, e[tok : tok + 1])

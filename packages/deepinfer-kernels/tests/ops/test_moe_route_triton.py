"""moe_route_topk: the Triton router vs the reference under Triton's interpreter on CPU (every scoring, with and
without the selection bias and the normalisation, V4 / V4.1 / odd expert counts, very negative logits where a
naive softplus would tie, a NaN logit) and on CUDA at V4.1-Flash shapes (384 experts, top-6), where a token alone
also equals the same token among 4096, bitwise.

moe_route_hash: the Triton hash router vs the reference at V4-Flash shapes (256 experts, top-6, a table of 129280
rows), every scoring, with and without the normalisation, int32 / int64 / narrower tables and ids, strided logits
and tables, the range errors, ids out of range left unchecked (no access outside the tensors), the softmax past
MAX_EXPERTS (reference fallback) under the interpreter; on CUDA at T = 1 / 8 / 64 / 256, a token alone vs among
256 bitwise, no host synchronisation with check_ranges=False, and a CUDA graph replayed with new ids."""

import pytest
import torch
from deepinfer_kernels.ops.moe import moe_route_hash, moe_route_topk
from deepinfer_kernels.ops.moe.reference import moe_route_hash_ref, moe_route_topk_ref

pytest.importorskip("triton")

from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _logits(t: int, e: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(device), (torch.randn(e, generator=g) * 0.1).to(device)


def _same(logits, bias, k, what, **kw):
    from deepinfer_kernels.ops.moe.route_triton import moe_route_topk_triton

    w, e = moe_route_topk_triton(logits, bias, k, route_scale=1.5, **kw)
    _agree(w, e, *moe_route_topk_ref(logits, bias, k, route_scale=1.5, **kw), what)


def _agree(w, e, w_ref, e_ref, what):
    """The kernel's (weights, experts) against the reference's: dtypes, the same experts, weights to 1e-5."""
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


V4_EXPERTS, V4_TOPK, V4_VOCAB = 256, 6, 129280  # V4-Flash's hash layers


def _hash_inputs(t: int, e: int, k: int, v: int, seed: int, dtype=torch.int64, device: str = "cpu"):
    """Router logits [t, e], a tid2eid table [v, k] of ``dtype`` and token ids [t] of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    table = torch.randint(0, e, (v, k), generator=g).to(dtype)
    ids = torch.randint(0, v, (t,), generator=g).to(dtype)
    return logits.to(device), table.to(device), ids.to(device)


def _same_hash(logits, table, ids, what, **kw):
    from deepinfer_kernels.ops.moe.route_triton import moe_route_hash_triton

    w, e = moe_route_hash_triton(logits, table, ids, route_scale=1.5, **kw)
    w_ref, e_ref = moe_route_hash_ref(logits, table, ids, route_scale=1.5, **kw)
    _agree(w, e, w_ref, e_ref, what)
    worst = float(((w.double() - w_ref.double()).abs() / w_ref.double().abs()).max()) if w.numel() else 0.0
    assert worst <= 1e-5, f"{what}: a weight is off by {worst:.2e} relative"
    return w, e


def _interp_hash_matches_reference(e: int, k: int, v: int):
    for dtype in (torch.int32, torch.int64):
        logits, table, ids = _hash_inputs(37, e, k, v, seed=e + k, dtype=dtype)
        for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
            for norm in (True, False):
                _same_hash(logits, table, ids, f"E={e} k={k} {dtype} {scoring} norm={norm}", scoring=scoring,
                           norm_topk=norm)  # fmt: skip
        _same_hash(logits - 30, table, ids, f"E={e} k={k} {dtype} very negative logits")
        strided = torch.cat([logits, logits], dim=1)[:, :e]  # rows with a stride of 2E
        _same_hash(strided, table, ids, f"E={e} k={k} {dtype} strided rows", scoring="softmax")
        _same_hash(logits, table.t().contiguous().t(), ids, f"E={e} k={k} {dtype} column-major table")
        _same_hash(logits, table, torch.stack([ids, ids], 1)[:, 0], f"E={e} k={k} {dtype} strided ids")
        _same_hash(logits, table, ids, f"E={e} k={k} {dtype} unchecked", check_ranges=False)


def _interp_hash_dtypes_and_edges():
    logits, table, ids = _hash_inputs(9, 200, 4, 300, seed=5)
    _same_hash(logits, table.to(torch.uint8), ids.to(torch.int16), "uint8 table, int16 ids")
    _same_hash(logits.bfloat16(), table, ids, "bf16 logits", scoring="softmax")
    w, e = _same_hash(logits[:0], table, ids[:0], "no tokens")
    assert w.shape == e.shape == (0, 4)
    big, table, ids = _hash_inputs(5, 2048, 6, 300, seed=6)  # past MAX_EXPERTS: softmax falls back
    for scoring in ("sqrtsoftplus", "softmax"):
        _same_hash(big, table, ids, f"2048 experts {scoring}", scoring=scoring)


def _interp_hash_ranges():
    from deepinfer_kernels.ops.moe.route_triton import moe_route_hash_triton

    logits, table, ids = _hash_inputs(6, 64, 6, 100, seed=7)
    for bad_ids in (ids + 100, ids - 100):
        with pytest.raises(ValueError, match=r"token ids span"):
            moe_route_hash_triton(logits, table, bad_ids, route_scale=1.5)
    bad = table.clone()
    bad[ids[2], 3] = 64
    with pytest.raises(ValueError, match=r"tid2eid gives experts in \[0, 64\], have 64"):
        moe_route_hash_triton(logits, bad, ids, route_scale=1.5)
    # unchecked: rows with bad ids or entries are unspecified, but nothing outside the tensors is read
    bad_ids = ids.clone()
    bad_ids[[0, 4]] = torch.tensor([100, -1])
    for scoring in ("sqrtsoftplus", "softmax"):
        w, e = moe_route_hash_triton(logits, bad, bad_ids, route_scale=1.5, scoring=scoring, check_ranges=False)
        w_ref, e_ref = moe_route_hash_ref(logits, table, ids, route_scale=1.5, scoring=scoring)
        good = [r for r in (1, 3, 5) if ids[r] != ids[2]]
        assert torch.equal(e[good], e_ref[good])
        assert_rel_close(w[good], w_ref[good], 1e-5, f"unchecked {scoring}")


INTERP_CASES = {
    "v4-256-top6": ("_interp_matches_reference", (256, 6)),
    "v41-384-top6": ("_interp_matches_reference", (384, 6)),
    "odd-20-top3": ("_interp_matches_reference", (20, 3)),
    "one-expert-top1": ("_interp_matches_reference", (1, 1)),
    "nan": ("_interp_nan", ()),
    "hash-v4-256-top6": ("_interp_hash_matches_reference", (V4_EXPERTS, V4_TOPK, V4_VOCAB)),
    "hash-odd-20-top3": ("_interp_hash_matches_reference", (20, 3, 77)),
    "hash-one-expert-top1": ("_interp_hash_matches_reference", (1, 1, 5)),
    "hash-dtypes-edges": ("_interp_hash_dtypes_and_edges", ()),
    "hash-ranges": ("_interp_hash_ranges", ()),
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t", [1, 8, 64, 256])
def test_gpu_hash_v4_shapes(t, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from deepinfer_kernels import registry
    from deepinfer_kernels.ops.moe.route_triton import moe_route_hash_triton

    if not registry.force_reference():  # what a step on CUDA runs
        assert registry.resolve("moe_route_hash", "cuda") is moe_route_hash_triton
    logits, table, ids = _hash_inputs(t, V4_EXPERTS, V4_TOPK, V4_VOCAB, seed=t, dtype=dtype, device="cuda")
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        for norm in (True, False):
            what = f"T={t} {dtype} {scoring} norm={norm}"
            w, e = _same_hash(logits, table, ids, what, scoring=scoring, norm_topk=norm)
            w2, e2 = moe_route_hash(logits, table, ids, route_scale=1.5, scoring=scoring, norm_topk=norm)
            assert_bitwise(w2, w, f"{what}: dispatched")
            assert torch.equal(e2, e)
            _same_hash(logits, table, ids, f"{what} unchecked", scoring=scoring, norm_topk=norm, check_ranges=False)


@pytest.mark.gpu
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_gpu_hash_batch_invariance_and_no_sync(scoring):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits, table, ids = _hash_inputs(256, V4_EXPERTS, V4_TOPK, V4_VOCAB, seed=11, device="cuda")
    w, e = moe_route_hash(logits, table, ids, route_scale=1.5, scoring=scoring)
    for tok in (0, 100, 255):
        w1, e1 = moe_route_hash(logits[tok : tok + 1], table, ids[tok : tok + 1], route_scale=1.5, scoring=scoring)
        assert_bitwise(w1, w[tok : tok + 1], f"{scoring}: token {tok} alone vs among 256")
        assert torch.equal(e1, e[tok : tok + 1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host synchronisation raises
    try:
        w2, e2 = moe_route_hash(logits, table, ids, route_scale=1.5, scoring=scoring, check_ranges=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bitwise(w2, w, f"{scoring}: unchecked")
    assert torch.equal(e2, e)


@pytest.mark.gpu
def test_gpu_hash_range_errors():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits, table, ids = _hash_inputs(8, V4_EXPERTS, V4_TOPK, V4_VOCAB, seed=12, device="cuda")
    with pytest.raises(ValueError, match="token ids span"):
        moe_route_hash(logits, table, ids + V4_VOCAB, route_scale=1.5)
    bad = table.clone()
    bad[ids[3], 2] = V4_EXPERTS
    with pytest.raises(ValueError, match="tid2eid gives experts"):
        moe_route_hash(logits, bad, ids, route_scale=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("check_ranges", [False, True])  # True: the checks are skipped while capturing
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_hash_cuda_graph_replay_with_new_ids(t, check_ranges):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits, table, ids = _hash_inputs(t, V4_EXPERTS, V4_TOPK, V4_VOCAB, seed=20, device="cuda")
    kw = dict(route_scale=1.5, scoring="sqrtsoftplus", check_ranges=check_ranges)
    moe_route_hash(logits, table, ids, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, e = moe_route_hash(logits, table, ids, **kw)
    for seed in (21, 22):
        new_logits, _, new_ids = _hash_inputs(t, V4_EXPERTS, V4_TOPK, V4_VOCAB, seed=seed, device="cuda")
        logits.copy_(new_logits)
        ids.copy_(new_ids)
        graph.replay()
        w_ref, e_ref = moe_route_hash_ref(new_logits, table, new_ids, route_scale=1.5)
        assert torch.equal(e, e_ref), f"replay {seed}: experts"
        assert_rel_close(w, w_ref, 1e-5, f"replay {seed}")

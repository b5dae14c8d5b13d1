"""Dense expert GEMMs (``grouped_gemm``, ``grouped_gemm_gather``) and the GPU backend of ``moe_experts`` built on
them.

(a) the references against a float64 formulation written here, the two layouts against each other, and a whole
MoE layer (permute -> gate/up -> down -> unpermute) against ``moe_experts``; (b) the Triton kernels and the
``moe_experts`` composition under TRITON_INTERPRET=1 on small CPU shapes (one child process); (c) GPU tests
with fresh random inputs at V4-Flash shapes (hidden 4096, 256 experts of width 2048, top-6) and V4.1-Flash
shapes (hidden 5120, 384 experts of width 2304, top-6), swiglu_limit 10: the ops and ``moe_experts`` against
the references, no host synchronisation, bitwise batch invariance across both layouts, and the registry's
choice.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels import registry
from deepinfer_kernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_gather
from deepinfer_kernels.ops.moe import moe_experts
from deepinfer_kernels.ops.moe.reference import moe_experts_ref
from deepinfer_kernels.ops.moe_permute import moe_permute, moe_unpermute
from deepinfer_kernels.registry import reference
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
LIMIT = 10.0  # swiglu_limit of V4 / V4.1
V4 = (4096, 2048, 256, 6)  # hidden, moe_intermediate_size, routed experts, top-k (V4-Flash)
V41 = (5120, 2304, 384, 6)  # V4.1-Flash


def routing(t, e, k, seed, device="cpu"):
    """top-k distinct experts per token and positive weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    experts = torch.rand(t, e, generator=g, device=device).argsort(dim=1)[:, :k]
    weights = torch.rand(t, k, generator=g, device=device) + 0.1
    return experts, weights


def stacks(e, d, inter, seed, dtype, device="cpu"):
    """w13 [E, 2I, d] and w2 [E, d, I] scaled so that gate/up values reach the clamp at 10 now and then."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, d, generator=g, device=device, dtype=dtype) * (3 / d**0.5)).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g, device=device, dtype=dtype) * (1 / inter**0.5)).to(dtype)
    return w13, w2


def swiglu64(y, limit):
    half = y.shape[-1] // 2
    gate, up = y[..., :half].clamp(max=limit), y[..., half:].clamp(-limit, limit)
    return gate / (1 + torch.exp(-gate)) * up


# ---------------------------------------------------------------- (a) references


@pytest.mark.parametrize("fuse", [False, True])
def test_grouped_reference_matches_float64(fuse):
    e, n, k, rows = 3, 64, 96, 11
    g = torch.Generator().manual_seed(1)
    w = torch.randn(e, n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    offsets = torch.tensor([0, 4, 4, rows])  # expert 1 owns no rows
    rs = torch.rand(rows, generator=g)
    got = grouped_gemm(x, w, offsets, fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=rs, out_dtype=torch.float32)
    expert_of_row = [0] * 4 + [2] * 7
    y = torch.stack([x[r].double() @ w[expert_of_row[r]].double().T for r in range(rows)])
    want = (swiglu64(y, LIMIT) if fuse else y) * rs.double()[:, None]
    assert_rel_close(got, want.float(), 1e-5, "grouped reference vs float64")


def test_gather_equals_grouped_reference():
    """The same pairs through both layouts give the same bits (both use the row-invariant linear_ref)."""
    t, e, k, d, inter = 9, 5, 2, 64, 32
    w13, _ = stacks(e, d, inter, seed=3, dtype=torch.bfloat16)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    experts, weights = routing(t, e, k, seed=5)
    xs, order, offsets = moe_permute(x, experts, e)
    grouped = grouped_gemm(xs, w13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order],
                           out_dtype=torch.float32)  # fmt: skip
    gathered = grouped_gemm_gather(x, w13, experts.flatten(), row_index=torch.arange(t * k) // k,
                                   fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten(),
                                   out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(gathered[order], grouped, "gathered rows (sorted) vs grouped rows")


def test_moe_layer_matches_moe_experts():
    t, e, k, d, inter = 13, 6, 3, 64, 32
    w13, w2 = stacks(e, d, inter, seed=6, dtype=torch.float32)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(8)) * 4
    experts, weights = routing(t, e, k, seed=9)
    xs, order, offsets = moe_permute(x, experts, e)
    h = grouped_gemm(xs, w13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order],
                     out_dtype=torch.float32)  # fmt: skip
    out = moe_unpermute(grouped_gemm(h, w2, offsets, out_dtype=torch.float32), order, t)
    assert_rel_close(out, moe_experts(x, experts, weights, w13, w2, swiglu_limit=LIMIT), 1e-6, "layer vs moe_experts")


def test_validation():
    w = torch.randn(2, 64, 32)
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="expert_offsets"):
        grouped_gemm(x, w, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="do not fit"):
        grouped_gemm(torch.randn(3, 16), w, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="bfloat16/float32"):
        grouped_gemm(x, w.half(), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="even N"):
        grouped_gemm(x, w[:, :63], torch.tensor([0, 1, 3]), fuse_swiglu=True)
    with pytest.raises(ValueError, match="row_index"):
        grouped_gemm_gather(x, w, torch.tensor([0, 1]), row_index=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="one entry per row"):
        grouped_gemm_gather(x, w, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="row_index"):
        grouped_gemm(x, w, torch.tensor([0, 1, 3]), row_index=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="row_scale"):  # R is row_index's length (4), not x's (3)
        grouped_gemm(x, w, torch.tensor([0, 1, 4]), row_index=torch.tensor([0, 2, 1, 1]), row_scale=torch.ones(3))


def test_moe_sort_is_moe_permutes_sort():
    from deepinfer_kernels.ops.moe_permute import moe_sort

    x = torch.randn(9, 8)
    experts, _ = routing(9, 6, 2, seed=4)
    xs, order, offsets = moe_permute(x, experts, 6)
    order2, offsets2 = moe_sort(experts, 6)
    assert torch.equal(order, order2) and torch.equal(offsets, offsets2)
    assert torch.equal(xs, x[order2 // 2])
    with pytest.raises(ValueError, match="moe_sort"):
        moe_sort(experts.float(), 6)


def test_registration():
    """The CUDA backends are registered batch-invariant; CPU tensors and forced references take the reference."""
    import deepinfer_kernels.ops.grouped_gemm  # noqa: F401

    for op in ("grouped_gemm", "grouped_gemm_gather", "moe_experts"):
        backends = registry._OPS[op].backends
        if triton_importable():
            assert backends["triton"].devices == ("cuda",) and backends["triton"].batch_invariant, op
        assert registry.resolve(op, "cpu") is registry.reference(op)


@needs_triton
def test_layouts_share_block_k():
    """The two layouts may tile rows and columns differently but must walk K in the same steps, or a row's bits
    would change with the layout (which follows the batch size)."""
    from deepinfer_kernels.ops.grouped_gemm import triton as backend

    bf16 = (backend.GATHER_CFG[torch.bfloat16], backend.GROUPED_CFG[torch.bfloat16], backend.GROUPED_WIDE_CFG)
    assert len({cfg["BLOCK_K"] for cfg in bf16}) == 1
    assert backend.GATHER_CFG[torch.float32] == backend.GROUPED_CFG[torch.float32]  # FMA dots: one tiling


# ---------------------------------------------------------------- (b) Triton interpreter


def _interp_layouts(w_dtype: str, x_dtype: str, fuse: bool, k: int) -> None:
    from deepinfer_kernels.ops.grouped_gemm import triton as backend

    e, inter, t, top = 5, 48, 9, 2
    wd, xd = getattr(torch, w_dtype), getattr(torch, x_dtype)
    w = (torch.randn(e, 2 * inter if fuse else 80, k, generator=torch.Generator().manual_seed(k)) / k**0.5).to(wd)
    x = (torch.randn(t, k, generator=torch.Generator().manual_seed(1)) * 6).to(xd)
    experts, weights = routing(t, e - 1, top, seed=2)  # the last expert owns no rows
    xs, order, offsets = moe_permute(x, experts, e)
    for out_dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-6)):
        kw = dict(fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=weights.flatten()[order], out_dtype=out_dtype)
        ref = reference("grouped_gemm")(xs, w, offsets, **{**kw, "out_dtype": torch.float32})
        got = backend.grouped_gemm_triton(xs, w, offsets, **kw)
        assert got.dtype == out_dtype
        assert_rel_close(got, ref, tol, f"contiguous -> {out_dtype}")
    # contiguous layout reading the tokens in place through row_index: the sorted copy's bits
    kw = dict(fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=weights.flatten()[order], out_dtype=torch.float32)
    got = backend.grouped_gemm_triton(x, w, offsets, row_index=order // top, **kw)
    assert_bitwise(got, backend.grouped_gemm_triton(xs, w, offsets, **kw), "contiguous, row_index vs sorted copy")
    assert_bitwise(reference("grouped_gemm")(x, w, offsets, row_index=order // top, **kw),
                   reference("grouped_gemm")(xs, w, offsets, **kw), "reference, row_index vs sorted copy")  # fmt: skip
    # gathered layout: token-major x with row_index, and pair-major rows without it
    kw = dict(row_index=torch.arange(t * top) // top, fuse_swiglu=fuse, swiglu_limit=LIMIT,
              row_scale=weights.flatten(), out_dtype=torch.float32)  # fmt: skip
    ref = reference("grouped_gemm_gather")(x, w, experts.flatten(), **kw)
    got = backend.grouped_gemm_gather_triton(x, w, experts.flatten(), **kw)
    assert_rel_close(got, ref, 1e-6, "gather, index")
    # the same rows without the index tensor: pair p reads token p // top
    kw.pop("row_index")
    assert_bitwise(backend.grouped_gemm_gather_triton(x, w, experts.flatten(), rows_per_input=top, **kw), got,
                   "gather, rows_per_input vs row_index")  # fmt: skip
    ids = experts.flatten()[order]
    ref = reference("grouped_gemm_gather")(xs, w, ids, fuse_swiglu=fuse, out_dtype=torch.float32)
    got = backend.grouped_gemm_gather_triton(xs, w, ids, fuse_swiglu=fuse, out_dtype=torch.float32)
    assert_rel_close(got, ref, 1e-6, "gather without row_index, no clamp")


def _interp_moe_experts() -> None:
    """``moe_experts_triton`` in both layouts (the sub-ops pinned to their Triton backends, which the
    interpreter runs on CPU tensors) against the reference."""
    import os

    for op in ("GROUPED_GEMM", "GROUPED_GEMM_GATHER", "MOE_UNPERMUTE"):
        os.environ[f"DEEPINFER_BACKEND_{op}"] = "triton"
    from deepinfer_kernels.ops.moe import triton as moe_backend

    e, d, inter, top = 40, 64, 32, 3
    w13, w2 = stacks(e, d, inter, seed=3, dtype=torch.bfloat16)
    for t in (1, 7):  # 3 rows of 40 experts: gathered; 21 rows: sorted
        x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        experts, weights = routing(t, e, top, seed=t)
        assert moe_backend.gather_layout(t, top, e) == (t == 1)
        got = moe_backend.moe_experts_triton(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
        want = moe_experts_ref(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
        assert got.dtype == torch.bfloat16
        assert_rel_close(got, want, 1e-2, f"moe_experts, {t} tokens")
        got32 = moe_backend.moe_experts_triton(x.float(), experts, weights, w13, w2, swiglu_limit=None)
        want32 = moe_experts_ref(x.float(), experts, weights, w13, w2, swiglu_limit=None)
        assert_rel_close(got32, want32, 1e-6, f"moe_experts fp32 x, no clamp, {t} tokens")


INTERPRETED = {
    "bf16w-bf16x-swiglu-K128": ("_interp_layouts", ("bfloat16", "bfloat16", True, 128)),
    "bf16w-fp32x-plain-K96": ("_interp_layouts", ("bfloat16", "float32", False, 96)),
    "fp32w-bf16x-swiglu-K40": ("_interp_layouts", ("float32", "bfloat16", True, 40)),
    "moe_experts": ("_interp_moe_experts", ()),
}


# every case in one TRITON_INTERPRET=1 child process
test_triton_interpreted = needs_triton(interpreted_cases_test(__file__, INTERPRETED))


# ---------------------------------------------------------------- (c) GPU, V4 / V4.1-Flash shapes


@pytest.fixture(scope="module")
def v4_stacks():
    d, inter, e, _ = V4
    return stacks(e, d, inter, seed=11, dtype=torch.bfloat16, device="cuda")


def _tokens(t, shape, seed):
    d, _, e, k = shape
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).cuda()
    experts, weights = routing(t, e, k, seed=seed + 1)
    return x, experts.cuda(), weights.cuda()


def _check_moe(x, experts, weights, w13, w2, what):
    from deepinfer_kernels.ops.moe import triton as moe_backend

    assert registry.resolve("moe_experts", "cuda") is moe_backend.moe_experts_triton
    got = moe_experts(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
    want = moe_experts_ref(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
    assert got.dtype == x.dtype
    # the backend rounds the hidden state to bf16 for the down GEMM (the reference keeps it fp32), then both
    # round the same fp32 sums (up to their order) to bf16 once
    assert_rel_close(got, want, 4e-3, what)
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        again = moe_experts(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_bitwise(again, got, f"{what}: second call")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_gpu_moe_experts_v4(v4_stacks, t):
    from deepinfer_kernels.ops.grouped_gemm import triton as backend

    w13, w2 = v4_stacks
    x, experts, weights = _tokens(t, V4, seed=t)
    _check_moe(x, experts, weights, w13, w2, f"moe_experts V4, {t} tokens")
    # the ops themselves, fp32 out: only the order of the K sums differs from the reference
    k = V4[3]
    ids = experts.flatten()
    kw = dict(row_index=torch.arange(t * k, device="cuda") // k, fuse_swiglu=True, swiglu_limit=LIMIT,
              row_scale=weights.flatten(), out_dtype=torch.float32)  # fmt: skip
    h = backend.grouped_gemm_gather_triton(x, w13, ids, **kw)
    assert_rel_close(h, reference("grouped_gemm_gather")(x, w13, ids, **kw), 1e-5, f"gather gate/up, {t} tokens")
    kw.pop("row_index")  # pair p reads token p // k without the index tensor: the same bits
    assert_bitwise(backend.grouped_gemm_gather_triton(x, w13, ids, rows_per_input=k, **kw), h,
                   f"gather gate/up, rows_per_input vs row_index, {t} tokens")  # fmt: skip
    xs, order, offsets = moe_permute(x, experts, V4[2])
    hs = backend.grouped_gemm_triton(xs, w13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT,
                                     row_scale=weights.flatten()[order], out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(hs, h[order], f"contiguous vs gathered gate/up rows, {t} tokens")
    hi = backend.grouped_gemm_triton(x, w13, offsets, row_index=order // k, fuse_swiglu=True, swiglu_limit=LIMIT,
                                     row_scale=weights.flatten()[order], out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(hi, hs, f"contiguous reading the tokens in place (row_index) vs the sorted copy, {t} tokens")
    y = backend.grouped_gemm_triton(hs, w2, offsets, out_dtype=torch.float32)
    y_ref = reference("grouped_gemm")(hs, w2, offsets, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-5, f"contiguous down (fp32 input), {t} tokens")
    assert_bitwise(backend.grouped_gemm_gather_triton(h, w2, ids, out_dtype=torch.float32)[order], y,
                   f"gathered vs contiguous down rows, {t} tokens")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_moe_experts_v41(t):
    d, inter, e, _ = V41
    w13, w2 = stacks(e, d, inter, seed=12, dtype=torch.bfloat16, device="cuda")
    x, experts, weights = _tokens(t, V41, seed=100 + t)
    _check_moe(x, experts, weights, w13, w2, f"moe_experts V4.1, {t} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 40])
def test_gpu_moe_experts_fp32_weights(t):
    w13, w2 = stacks(16, 512, 256, seed=13, dtype=torch.float32, device="cuda")
    x = torch.randn(t, 512, device="cuda")
    experts, weights = routing(t, 16, 4, seed=t, device="cuda")
    got = moe_experts(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
    assert_rel_close(got, moe_experts_ref(x, experts, weights, w13, w2, swiglu_limit=LIMIT), 1e-5, f"fp32, {t}")


@pytest.mark.gpu
def test_gpu_batch_invariant(v4_stacks):
    """A token alone (gathered layout) equals the same token among 4 (gathered), 8 and 512 (sorted, narrow tiles)
    and 4096 (sorted, wide tiles), bitwise, through moe_experts, in normal and in batch-invariant mode."""
    from deepinfer_kernels.ops.grouped_gemm import triton as backend
    from deepinfer_kernels.ops.moe import triton as moe_backend

    w13, w2 = v4_stacks
    x, experts, weights = _tokens(4096, V4, seed=7)
    d, _, e, k = V4
    assert moe_backend.gather_layout(4, k, e) and not moe_backend.gather_layout(8, k, e)
    assert backend._grouped_cfg(torch.bfloat16, 512 * k, e) is not backend._grouped_cfg(torch.bfloat16, 4096 * k, e)
    for invariant in (False, True):
        registry.set_batch_invariant(invariant)
        try:
            assert registry.resolve("moe_experts", "cuda") is moe_backend.moe_experts_triton
            full = moe_experts(x, experts, weights, w13, w2, swiglu_limit=LIMIT)
            for t in (4, 8, 512):
                part = moe_experts(x[:t], experts[:t], weights[:t], w13, w2, swiglu_limit=LIMIT)
                assert_bitwise(part, full[:t], f"{t} tokens vs the same among 4096")
            for tok in (0, 5, 300, 4095):
                one = moe_experts(x[tok : tok + 1], experts[tok : tok + 1], weights[tok : tok + 1], w13, w2,
                                  swiglu_limit=LIMIT)  # fmt: skip
                assert_bitwise(one, full[tok : tok + 1], f"token {tok} alone vs among 4096")
        finally:
            registry.set_batch_invariant(None)


@pytest.mark.gpu
def test_gpu_registry_choice(monkeypatch):
    from deepinfer_kernels.ops.grouped_gemm import triton as backend
    from deepinfer_kernels.ops.moe import triton as moe_backend

    assert registry.resolve("moe_experts", "cuda") is moe_backend.moe_experts_triton
    assert registry.resolve("grouped_gemm", "cuda") is backend.grouped_gemm_triton
    assert registry.resolve("grouped_gemm_gather", "cuda") is backend.grouped_gemm_gather_triton
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    for op in ("moe_experts", "grouped_gemm", "grouped_gemm_gather"):
        assert registry.resolve(op, "cuda") is registry.reference(op)

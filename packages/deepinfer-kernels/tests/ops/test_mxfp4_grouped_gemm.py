"""MXFP4 expert GEMMs: contiguous (prefill) and gathered (decode) layouts, fused clamped SwiGLU.

(a) the references against a float64 formulation written here (codes decoded through a table of E2M1 values,
scales 2^(byte-127), explicit loops over experts), the two layouts against each other, and a whole MoE
layer (permute -> gate/up -> down -> unpermute) against ``moe_experts``; (b) the Triton kernels under
TRITON_INTERPRET=1 on small CPU shapes (child processes); (c) GPU tests at V4.1-Flash shapes (hidden 5120,
384 experts of width 2304, top-6, swiglu_limit 10) and bitwise row invariance.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_kernels.ops.moe import moe_experts
from deepinfer_kernels.ops.moe_permute import moe_permute, moe_unpermute
from deepinfer_kernels.ops.mxfp4_grouped_gemm import mxfp4_grouped_gemm, mxfp4_grouped_gemm_gather
from deepinfer_kernels.ops.quant.formats import E2M1_VALUES
from deepinfer_kernels.registry import reference
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
LIMIT = 10.0  # swiglu_limit of V4 / V4.1
HIDDEN, INTER, EXPERTS, TOP_K = 5120, 2304, 384, 6  # V4.1-Flash


def make_weights(e, n, k, seed, device="cpu", scale_lo=118, scale_hi=124):
    """Random packed E2M1 bytes (every byte is two valid codes) and UE8M0 scale bytes around 2^-6."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8, device=device).view(torch.int8)
    s = torch.randint(scale_lo, scale_hi, (e, n, k // 32), generator=g, dtype=torch.uint8, device=device)
    return w, s.view(torch.float8_e8m0fnu)


def dense_float64(w, s):
    """Independent decode: [E, N, K] float64 from bytes (low nibble = even column) and scale bytes."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    u = w.view(torch.uint8).long().cpu()
    codes = torch.empty(*u.shape[:-1], 2 * u.shape[-1], dtype=torch.long)
    codes[..., 0::2] = u & 15
    codes[..., 1::2] = u >> 4
    scale = torch.pow(2.0, s.view(torch.uint8).cpu().double() - 127)
    return lut[codes] * scale.repeat_interleave(32, dim=-1)


def swiglu64(y, limit):
    half = y.shape[-1] // 2
    gate, up = y[..., :half].clamp(max=limit), y[..., half:].clamp(-limit, limit)
    return gate / (1 + torch.exp(-gate)) * up


def routing(t, e, k, seed, device="cpu"):
    """top-k distinct experts per token and positive weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    experts = torch.rand(t, e, generator=g, device=device).argsort(dim=1)[:, :k]
    weights = torch.rand(t, k, generator=g, device=device) + 0.1
    return experts, weights


# ---------------------------------------------------------------- (a) references


@pytest.mark.parametrize("fuse", [False, True])
def test_grouped_reference_matches_float64(fuse):
    e, n, k, rows = 3, 64, 96, 11
    w, s = make_weights(e, n, k, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=g) * 8  # large enough that the clamp at 10 bites
    offsets = torch.tensor([0, 4, 4, rows])  # expert 1 owns no rows
    rs = torch.rand(rows, generator=g)
    got = mxfp4_grouped_gemm(x, w, s, offsets, fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=rs,
                             out_dtype=torch.float32)  # fmt: skip
    wd = dense_float64(w, s)
    expert_of_row = [0] * 4 + [2] * 7
    y = torch.stack([x[r].double() @ wd[expert_of_row[r]].T for r in range(rows)])
    want = (swiglu64(y, LIMIT) if fuse else y) * rs.double()[:, None]
    assert_rel_close(got, want.float(), 1e-5, "grouped reference vs float64")


def test_gather_equals_grouped_reference():
    """The same pairs through both layouts give the same bits (both use the row-invariant linear_ref)."""
    t, e, k, d, inter = 9, 5, 2, 64, 32
    w, s = make_weights(e, 2 * inter, d, seed=3)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    experts, weights = routing(t, e, k, seed=5)
    xs, order, offsets = moe_permute(x, experts, e)
    grouped = mxfp4_grouped_gemm(xs, w, s, offsets, fuse_swiglu=True, swiglu_limit=LIMIT,
                                 row_scale=weights.flatten()[order], out_dtype=torch.float32)  # fmt: skip
    gathered = mxfp4_grouped_gemm_gather(x, w, s, experts.flatten(), row_index=torch.arange(t * k) // k,
                                         fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten(),
                                         out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(gathered[order], grouped, "gathered rows (sorted) vs grouped rows")
    by_rows = mxfp4_grouped_gemm_gather(x, w, s, experts.flatten(), rows_per_input=k, fuse_swiglu=True,
                                        swiglu_limit=LIMIT, row_scale=weights.flatten(),
                                        out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(by_rows, gathered, "rows_per_input = k vs row_index = arange(T * k) // k")


def test_moe_layer_matches_moe_experts():
    t, e, k, d, inter = 13, 6, 3, 64, 32
    w13, s13 = make_weights(e, 2 * inter, d, seed=6)
    w2, s2 = make_weights(e, d, inter, seed=7, scale_lo=122, scale_hi=128)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(8)) * 4
    experts, weights = routing(t, e, k, seed=9)
    xs, order, offsets = moe_permute(x, experts, e)
    h = mxfp4_grouped_gemm(xs, w13, s13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT,
                           row_scale=weights.flatten()[order], out_dtype=torch.float32)  # fmt: skip
    y = mxfp4_grouped_gemm(h, w2, s2, offsets, out_dtype=torch.float32)
    out = moe_unpermute(y, order, t)
    deq = reference("mxfp4_dequantize")
    w13d = torch.stack([deq(w13[i], s13[i]) for i in range(e)])
    w2d = torch.stack([deq(w2[i], s2[i]) for i in range(e)])
    want = moe_experts(x, experts, weights, w13d, w2d, swiglu_limit=LIMIT)
    assert_rel_close(out, want, 1e-5, "permute/grouped/unpermute vs moe_experts")


def test_sorted_row_index_reads_x_through_it():
    """``row_index``: the sorted rows read x[row_index[r]] (token-major x, each token on several rows), the same
    as the sorted copy of x, bitwise (reference)."""
    t, e, k, d, inter = 11, 5, 3, 64, 32
    w13, s13 = make_weights(e, 2 * inter, d, seed=16)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(17))
    experts, weights = routing(t, e, k, seed=18)
    xs, order, offsets = moe_permute(x, experts, e)
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order], out_dtype=torch.float32)
    want = mxfp4_grouped_gemm(xs, w13, s13, offsets, **kw)
    assert_bitwise(mxfp4_grouped_gemm(x, w13, s13, offsets, row_index=order // k, **kw), want, "row_index")


def test_validation():
    w, s = make_weights(2, 64, 64, seed=10)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="expert_offsets"):
        mxfp4_grouped_gemm(x, w, s, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="w_scale"):
        mxfp4_grouped_gemm(x, w, s[:, :, :1], torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="row_index"):
        mxfp4_grouped_gemm_gather(x, w, s, torch.tensor([0, 1]), row_index=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="row_index"):
        mxfp4_grouped_gemm(x, w, s, torch.tensor([0, 1, 2]), row_index=torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="row_index"):
        mxfp4_grouped_gemm(x, w, s, torch.tensor([0, 1, 2]), row_index=torch.tensor(1))
    with pytest.raises(ValueError, match="expert_offsets"):  # R is row_index's length: off[E] is not checked, E is
        mxfp4_grouped_gemm(x, w, s, torch.tensor([0, 2]), row_index=torch.tensor([2, 0, 1, 1]))
    with pytest.raises(ValueError, match="rows_per_input"):
        mxfp4_grouped_gemm_gather(x, w, s, torch.tensor([0, 1]), row_index=torch.tensor([0, 1]), rows_per_input=2)
    with pytest.raises(ValueError, match="rows_per_input"):
        mxfp4_grouped_gemm_gather(x, w, s, torch.tensor([0, 1]), rows_per_input=0)
    with pytest.raises(ValueError, match="one entry per row"):  # P must be R_in * rows_per_input
        mxfp4_grouped_gemm_gather(x, w, s, torch.tensor([0, 1, 1]), rows_per_input=2)


# ---------------------------------------------------------------- (b) Triton interpreter


def _interp_grouped(fuse: bool, k: int) -> None:
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as backend

    e, inter, t, top = 5, 48, 9, 2
    n = 2 * inter if fuse else 80
    w, s = make_weights(e, n, k, seed=k + fuse)
    x = (torch.randn(t, k, generator=torch.Generator().manual_seed(1)) * 6).to(torch.bfloat16)
    experts, weights = routing(t, e - 1, top, seed=2)  # the last expert owns no rows
    xs, order, offsets = moe_permute(x, experts, e)
    rs = weights.flatten()[order]
    for out_dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        kw = dict(fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=rs, out_dtype=out_dtype)
        ref = reference("mxfp4_grouped_gemm")(xs, w, s, offsets, **{**kw, "out_dtype": torch.float32})
        got = backend.mxfp4_grouped_gemm_triton(xs, w, s, offsets, **kw)
        assert_rel_close(got, ref, tol, f"grouped {out_dtype}")
        idx = backend.mxfp4_grouped_gemm_triton(x, w, s, offsets, row_index=order // top, **kw)
        assert_bitwise(idx, got, f"grouped {out_dtype}, x read through row_index")
    # gathered layout: token-major x with row_index, and pair-major rows without it
    idx = torch.arange(t * top) // top
    kw = dict(row_index=idx, fuse_swiglu=fuse, swiglu_limit=LIMIT, row_scale=weights.flatten())
    ref = reference("mxfp4_grouped_gemm_gather")(x, w, s, experts.flatten(), **kw, out_dtype=torch.float32)
    got = backend.mxfp4_grouped_gemm_gather_triton(x, w, s, experts.flatten(), **kw, out_dtype=torch.float32)
    assert_rel_close(got, ref, 1e-5, "gather with row_index")
    del kw["row_index"]  # the same rows read as pair p -> token p // top, without an index
    got = backend.mxfp4_grouped_gemm_gather_triton(x, w, s, experts.flatten(), **kw, rows_per_input=top,
                                                   out_dtype=torch.float32)  # fmt: skip
    assert_rel_close(got, ref, 1e-5, "gather with rows_per_input")
    ref = reference("mxfp4_grouped_gemm_gather")(xs, w, s, experts.flatten()[order], fuse_swiglu=fuse)
    got = backend.mxfp4_grouped_gemm_gather_triton(xs, w, s, experts.flatten()[order], fuse_swiglu=fuse)
    assert_rel_close(got, ref.float(), 1e-2, "gather without row_index, bf16, no clamp")
    print("ok")


def _interp_relabel() -> None:
    """The TMA kernel's x relabelling (a Triton copy) against its torch definition, and the definition against
    the in-register one of the wgmma kernel: a chunk of 128 columns is (even columns, odd columns), each half's
    packed index 32c + 8q + 2a + b at 32c + 8a + 2q + b."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon_tma import relabel_x, relabel_x_ref

    for r, k in ((1, 128), (37, 384), (70, 2304)):
        x = torch.randn(r, k, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
        assert_bitwise(relabel_x(x, 64), relabel_x_ref(x, 64), f"relabel {r}x{k}")
        idx = torch.randint(0, r, (2 * r + 3,), generator=torch.Generator().manual_seed(k))
        assert_bitwise(relabel_x(x, 64, idx), relabel_x_ref(x[idx], 64), f"relabel {r}x{k} through a row index")
    x = torch.arange(256.0).view(1, 256)
    y = relabel_x_ref(x, 64)
    for chunk in range(2):
        for t in range(2):  # t: even (low nibble) / odd (high nibble) columns
            for j in range(64):  # packed byte index of the chunk
                c, q, a, b = j // 32, (j // 8) % 4, (j // 2) % 4, j % 2
                assert y[0, 128 * chunk + 64 * t + 32 * c + 8 * a + 2 * q + b] == 128 * chunk + 2 * j + t
    print("ok")


INTERPRETED = {
    "swiglu-K128": ("_interp_grouped", (True, 128)),
    "plain-K96": ("_interp_grouped", (False, 96)),
    "relabel": ("_interp_relabel", ()),
}


# every case in one TRITON_INTERPRET=1 child process
test_triton_interpreted = needs_triton(interpreted_cases_test(__file__, INTERPRETED))


def _gluon_ptx_sm90(sorted_rows: bool, fuse: bool, fold: bool = False) -> tuple[str, int]:
    """The Gluon kernel compiled for sm_90 (PTX, not run: Gluon has no interpreter) as its launch specialises it."""
    import triton
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as backend
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*fp32", "rs_ptr": "*fp32", "expert_ptr": "*i32",
        "index_ptr": "*i64", "r0_ptr": "*i32", "r1_ptr": "*i32", "N_OUT": "i32", "K": "i32", "limit": "fp32",
        "RPI": "i32",
    }  # fmt: skip
    cfg = backend.SORTED_CFG if sorted_rows else backend.GATHER_CFG
    meta = dict(SORTED=sorted_rows, FUSE=fuse, HAS_LIMIT=fuse, HAS_RS=fuse, HAS_INDEX=fuse,
                BLOCK_N=cfg["BLOCK_N"], BKH=cfg["BKH"], NUM_WARPS=cfg["num_warps"], FOLD=fold)  # fmt: skip
    sig.update(dict.fromkeys(meta, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}
    src = GluonASTSource(fn=backend._expert_rows_kernel, signature=sig, constexprs=meta, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    return k.asm["ptx"], k.metadata.shared


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("sorted_rows,fuse", [(False, True), (False, False), (True, True), (True, False)])
def test_gluon_kernel_compiles_for_sm90(sorted_rows, fuse):
    """The layouts lower (the x halves are the B operand without a shuffle: ``assert_trivial``), weights stream as
    64-bit loads and x as 128-bit ones into bf16 ``mma.sync``, nothing spills, and shared memory is only the fused
    epilogue's exchange."""
    pytest.importorskip("triton.experimental.gluon")
    ptx, shared = _gluon_ptx_sm90(sorted_rows, fuse)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert ptx.count("ld.global.v2.b32") >= 8, "weight bytes in 64-bit loads"
    assert ptx.count("ld.global.v4.b32") >= 8, "x in 128-bit loads"
    assert ".local" not in ptx, "register spills"
    assert shared <= (1024 if fuse else 0), f"{shared} bytes of shared memory"


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("sorted_rows", [False, True])
def test_gluon_fold_halves_the_multiplies(sorted_rows):
    """With FOLD the unpack multiplies each bf16 pair once (by 2^(s-1)) instead of twice (2^126, then 2^(s-127)):
    half the ``mul.rn.bf16x2`` of a step, still no spills."""
    pytest.importorskip("triton.experimental.gluon")
    two, _ = _gluon_ptx_sm90(sorted_rows, True)
    one, _ = _gluon_ptx_sm90(sorted_rows, True, fold=True)
    assert one.count("mul.rn.bf16x2") * 2 == two.count("mul.rn.bf16x2") > 0
    assert "0x7E807E80" not in one and ".local" not in one


def test_fold_ok_reads_the_scales_once():
    """``fold_ok``: True when every scale byte is at most 128, False with one above; kept on the tensor until it
    changes in place (its version moves)."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon_common import FOLD_MAX_SCALE, fold_ok

    _, s = make_weights(2, 16, 64, seed=5)
    assert fold_ok(s) and s._deepinfer_fold_ok == (s._version, True)
    s.view(torch.uint8)[1, 3, 1] = FOLD_MAX_SCALE
    assert fold_ok(s), "a byte of 128 still folds (2^127 is a finite bf16)"
    s.view(torch.uint8)[1, 3, 1] = FOLD_MAX_SCALE + 1
    assert not fold_ok(s), "the in-place change is seen"
    s.view(torch.uint8)[1, 3, 1] = 120
    assert fold_ok(s)


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("fuse, fold", [(True, False), (False, False), (True, True)])
def test_gluon_wgmma_kernel_compiles_for_sm90(fuse, fold):
    """The wgmma kernel lowers for sm_90 with its register A operand relabelled, not shuffled (no shared memory
    but the two x tiles and the epilogue's exchange), weights in 64-bit loads, x in 128-bit ones, no spills, and
    ptxas keeps a step's wgmma in one group (a wait after the loop made it wait after each wgmma). Fused as the
    MoE's gate/up calls it: x read through a row index."""
    pytest.importorskip("triton.experimental.gluon")
    import triton
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_wgmma as backend
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16", "rs_ptr": "*fp32", "tile_e_ptr": "*i32",
        "r0_ptr": "*i32", "r1_ptr": "*i32", "index_ptr": "*i64", "N_OUT": "i32", "K": "i32", "limit": "fp32",
    }  # fmt: skip
    cfg = backend.WGMMA_CFG
    meta = dict(backend.wgmma_meta(cfg), FUSE=fuse, HAS_LIMIT=fuse, HAS_RS=not fuse, HAS_INDEX=fuse, FOLD=fold)
    sig.update(dict.fromkeys(meta, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(11)}
    src = GluonASTSource(fn=backend._expert_rows_wgmma_kernel, signature=sig, constexprs=meta, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in ptx
    assert ptx.count("ld.global.v2.b32") >= 4, "weight bytes in 64-bit loads"
    assert ptx.count("ld.global.v4.b32") >= 4, "x in 128-bit loads"
    assert ".local" not in ptx, "register spills"
    x_tiles = 2 * cfg["TN"] * cfg["BKH"] * 2
    assert k.metadata.shared <= x_tiles, f"{k.metadata.shared} bytes of shared memory (x tiles: {x_tiles})"
    sass = k.asm["sass"]
    waits = sass.count("WARPGROUP.DEPBAR")
    assert sass.count("HGMMA") == 2 * cfg["BKH"] // 16 and waits <= 2, f"wgmma serialised ({waits} waits)"


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize(
    "fuse, tn, fold",
    [(True, 128, False), (False, 128, False), (True, 32, False), (False, 64, False), (True, 16, False),
     (True, 128, True), (False, 128, True)],
)  # fmt: skip
def test_gluon_tma_kernel_compiles_for_sm90(fuse, tn, fold):
    """The TMA kernel lowers for sm_90, at its 128-row x tiles and the tail tiles' widths: x tiles by TMA (no x
    loads from global in the main loop), weights in 64-bit loads, the register A operand relabelled rather than
    moved through shared memory (the only shared-memory loads are the epilogue's exchange), no spills, and ptxas
    keeps a step's wgmma in flight while the next is prepared: one wait per step, not one per wgmma (its
    serialisation)."""
    pytest.importorskip("triton.experimental.gluon")
    import triton
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_tma as backend
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    cfg = dict(backend.TMA_CFG, **(backend.TMA_FUSED_CFG if fuse else {}), TN=tn)  # as tma_rows_into picks it
    desc = backend.x_descriptor(torch.zeros(cfg["TN"], 4 * cfg["BKH"], dtype=torch.bfloat16), cfg)
    sig = {
        "x_desc": mangle_type(desc), "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16" if fuse else "*fp32",
        "rs_ptr": "*fp32", "tile_e_ptr": "*i32", "r0_ptr": "*i32", "r1_ptr": "*i32", "N_OUT": "i32", "K": "i32",
        "limit": "fp32",
    }  # fmt: skip
    meta = dict(backend.tma_meta(cfg), FUSE=fuse, HAS_LIMIT=fuse, HAS_RS=fuse, FOLD=fold)
    sig.update(dict.fromkeys(meta, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(1, 10)}
    src = GluonASTSource(fn=backend._expert_rows_tma_kernel, signature=sig, constexprs=meta, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
    ptx, sass = k.asm["ptx"], k.asm["sass"]
    assert "cp.async.bulk.tensor.2d" in ptx, "x tiles by TMA"
    assert f"wgmma.mma_async.sync.aligned.m64n{tn}k16.f32.bf16.bf16" in ptx
    assert ptx.count("ld.global.v2.b32") >= 4, "weight bytes in 64-bit loads"
    assert "ld.global.v4" not in ptx, "x read by threads"
    assert ".local" not in ptx, "register spills"
    steps = 2  # the loop is unrolled by two
    assert sass.count("HGMMA") == steps * 2 * cfg["BKH"] // 16
    assert sass.count("WARPGROUP.DEPBAR") == steps + 1, "wgmma serialised"
    loop = sass[: sass.index("WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert " LDS" not in loop, "the A operand through shared memory"


# ---------------------------------------------------------------- (c) GPU, V4.1-Flash shapes


@pytest.fixture(scope="module")
def v41_experts():
    w13, s13 = make_weights(EXPERTS, 2 * INTER, HIDDEN, seed=21, device="cuda")
    w2, s2 = make_weights(EXPERTS, HIDDEN, INTER, seed=22, device="cuda", scale_lo=120, scale_hi=126)
    return w13, s13, w2, s2


def _tokens(t, seed):
    x = (torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 2).to(torch.bfloat16).cuda()
    experts, weights = routing(t, EXPERTS, TOP_K, seed=seed + 1)
    return x, experts.cuda(), weights.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 700])
def test_gpu_grouped_real_shapes(v41_experts, t):
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as backend

    w13, s13, w2, s2 = v41_experts
    x, experts, weights = _tokens(t, seed=t)
    xs, order, offsets = moe_permute(x, experts, EXPERTS)
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order])
    h = backend.mxfp4_grouped_gemm_triton(xs, w13, s13, offsets, **kw)
    h_ref = reference("mxfp4_grouped_gemm")(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    assert_rel_close(h, h_ref, 1e-2, f"gate/up + swiglu, {t} tokens")
    y = backend.mxfp4_grouped_gemm_triton(h, w2, s2, offsets)
    y_ref = reference("mxfp4_grouped_gemm")(h, w2, s2, offsets, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-2, f"down, {t} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_gather_real_shapes(v41_experts, t):
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as backend

    w13, s13, w2, s2 = v41_experts
    x, experts, weights = _tokens(t, seed=100 + t)
    ids = experts.flatten()
    kw = dict(row_index=torch.arange(t * TOP_K, device="cuda") // TOP_K, fuse_swiglu=True, swiglu_limit=LIMIT,
              row_scale=weights.flatten())  # fmt: skip
    h = backend.mxfp4_grouped_gemm_gather_triton(x, w13, s13, ids, **kw)
    h_ref = reference("mxfp4_grouped_gemm_gather")(x, w13, s13, ids, **kw, out_dtype=torch.float32)
    assert_rel_close(h, h_ref, 1e-2, f"gather gate/up, {t} tokens")
    y = backend.mxfp4_grouped_gemm_gather_triton(h, w2, s2, ids)
    y_ref = reference("mxfp4_grouped_gemm_gather")(h, w2, s2, ids, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-2, f"gather down, {t} tokens")
    # an fp32 input (the MoE layer's hidden state): the kernel rounds the operand to bf16, the reference does not
    y = backend.mxfp4_grouped_gemm_gather_triton(h_ref, w2, s2, ids, out_dtype=torch.float32)
    y_ref = reference("mxfp4_grouped_gemm_gather")(h_ref, w2, s2, ids, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-2, f"gather down from fp32, {t} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_gather_gluon_real_shapes(v41_experts, t):
    """The Gluon decode kernel (dispatch's choice on sm_90) against the reference, and a token's rows alone
    equal to its rows among t tokens, bitwise."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as backend

    w13, s13, w2, s2 = v41_experts
    x, experts, weights = _tokens(t, seed=200 + t)
    ids = experts.flatten()
    kw = dict(row_index=torch.arange(t * TOP_K, device="cuda") // TOP_K, fuse_swiglu=True, swiglu_limit=LIMIT,
              row_scale=weights.flatten())  # fmt: skip
    h = backend.mxfp4_grouped_gemm_gather_gluon(x, w13, s13, ids, **kw)
    h_ref = reference("mxfp4_grouped_gemm_gather")(x, w13, s13, ids, **kw, out_dtype=torch.float32)
    assert_rel_close(h, h_ref, 1e-2, f"gluon gather gate/up, {t} tokens")
    by_rows = {k: v for k, v in kw.items() if k != "row_index"}
    h_rows = backend.mxfp4_grouped_gemm_gather_gluon(x, w13, s13, ids, rows_per_input=TOP_K, **by_rows)
    assert_bitwise(h_rows, h, f"gluon gather: rows_per_input = k vs row_index, {t} tokens")
    h32 = backend.mxfp4_grouped_gemm_gather_gluon(x, w13, s13, ids, **kw, out_dtype=torch.float32)
    assert_rel_close(h32, h_ref, 1e-5, f"gluon gather gate/up fp32 out, {t} tokens")
    y = backend.mxfp4_grouped_gemm_gather_gluon(h, w2, s2, ids, out_dtype=torch.float32)
    y_ref = reference("mxfp4_grouped_gemm_gather")(h, w2, s2, ids, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-5, f"gluon gather down, {t} tokens")
    # N not a multiple of the 64-row tile, and a K the kernel does not serve (falls back to the Triton kernel)
    y = backend.mxfp4_grouped_gemm_gather_gluon(h, w2[:, :1000], s2[:, :1000], ids, out_dtype=torch.float32)
    assert_rel_close(y, y_ref[:, :1000], 1e-5, "gluon gather down, N = 1000")
    yk = backend.mxfp4_grouped_gemm_gather_gluon(h[:, :2240], w2[:, :, :1120], s2[:, :, :70], ids)
    yk_ref = reference("mxfp4_grouped_gemm_gather")(h[:, :2240], w2[:, :, :1120], s2[:, :, :70], ids)
    assert_rel_close(yk, yk_ref.float(), 1e-2, "gluon gather, K = 2240 (Triton fallback)")
    last = slice((t - 1) * TOP_K, t * TOP_K)
    one = backend.mxfp4_grouped_gemm_gather_gluon(x[t - 1 :], w13, s13, ids[last], fuse_swiglu=True,
                                                  swiglu_limit=LIMIT, row_index=torch.zeros(6, dtype=torch.long,
                                                  device="cuda"), row_scale=weights.flatten()[last])  # fmt: skip
    assert_bitwise(one, h[last], f"gluon gather: token {t - 1} alone vs among {t}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 2048])
def test_gpu_fold_gives_the_same_bits(v41_experts, t, monkeypatch):
    """The folded unpack (one multiply a pair) against two multiplies, gathered and sorted layouts (at 2048 tokens
    all four kernels: 8-row, wgmma, TMA and its tails), gate/up and down: the same bits (the products are the same
    exact values); a scale byte above 128 keeps two multiplies."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as backend
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_common
    from deepinfer_kernels.ops.mxfp4_grouped_gemm.gluon_common import fold_ok

    w13, s13, w2, s2 = v41_experts
    assert fold_ok(s13) and fold_ok(s2)
    x, experts, weights = _tokens(t, seed=300 + t)
    ids = experts.flatten()
    order = torch.argsort(ids, stable=True)
    offsets = torch.zeros(EXPERTS + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(torch.bincount(ids, minlength=EXPERTS), 0)
    rows = order // TOP_K
    pairs = torch.arange(t * TOP_K, device="cuda") // TOP_K
    swiglu = dict(fuse_swiglu=True, swiglu_limit=LIMIT)
    outs = {}
    for fold in (False, True):
        monkeypatch.setattr(gluon_common, "FOLD", fold)
        g = backend.mxfp4_grouped_gemm_gather_gluon(x, w13, s13, ids, row_index=pairs, **swiglu)
        h = backend.mxfp4_grouped_gemm_gluon(x, w13, s13, offsets, row_index=rows, **swiglu)
        y = backend.mxfp4_grouped_gemm_gluon(h, w2, s2, offsets, out_dtype=torch.float32)
        outs[fold] = (g, h, y)
    for name, a, b in zip(("gather gate/up", "sorted gate/up", "sorted down"), outs[False], outs[True]):
        assert_bitwise(b, a, f"fold vs two multiplies: {name}, {t} tokens")
    big = s2.clone()
    big.view(torch.uint8)[ids[0], 0, 0] = 129  # an expert the rows use: the byte is read
    assert not fold_ok(big)
    y_big = backend.mxfp4_grouped_gemm_gluon(h, w2, big, offsets, out_dtype=torch.float32)  # FOLD is on here
    monkeypatch.setattr(gluon_common, "FOLD", False)
    assert_bitwise(y_big, backend.mxfp4_grouped_gemm_gluon(h, w2, big, offsets, out_dtype=torch.float32), "byte 129")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_gpu_sorted_gluon_real_shapes(v41_experts, t, kernel, monkeypatch):
    """Each Gluon sorted-layout kernel alone (the 8-row mma.sync tiles, or the 32-row wgmma tiles) against the
    reference, and a token's rows alone equal to its rows among t tokens (bitwise)."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as backend

    if kernel == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma is sm_90 only")
    every = 1 << 20
    if kernel == "mma":  # below WGMMA_FROM_ROWS: every expert in the 8-row tiles
        monkeypatch.setattr(backend, "WGMMA_FROM_ROWS", every)
        monkeypatch.setattr(backend, "SMALL_MMA_MAX_ROWS", every)
    else:
        monkeypatch.setattr(backend, "WGMMA_FROM_ROWS", 0)
        monkeypatch.setattr(backend, "MMA_MAX_ROWS", 0)
        monkeypatch.setattr(backend, "WGMMA_MAX_ROWS", every)
    w13, s13, w2, s2 = v41_experts
    ref = reference("mxfp4_grouped_gemm")
    x, experts, weights = _tokens(t, seed=300 + t)
    xs, order, offsets = moe_permute(x, experts % (EXPERTS if t < 64 else 40), EXPERTS)  # t >= 64: ~10-45 rows
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order])
    h_ref = ref(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    h32 = backend.mxfp4_grouped_gemm_gluon(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    assert_rel_close(h32, h_ref, 1e-5, f"{kernel} sorted gate/up fp32 out, {t} tokens")
    h = backend.mxfp4_grouped_gemm_gluon(xs, w13, s13, offsets, **kw)
    assert_rel_close(h, h_ref, 1e-2, f"{kernel} sorted gate/up, {t} tokens")
    y = backend.mxfp4_grouped_gemm_gluon(h, w2, s2, offsets, out_dtype=torch.float32)
    y_ref = ref(h, w2, s2, offsets, out_dtype=torch.float32)
    assert_rel_close(y, y_ref, 1e-5, f"{kernel} sorted down, {t} tokens")
    y = backend.mxfp4_grouped_gemm_gluon(h, w2[:, :1000], s2[:, :1000], offsets, out_dtype=torch.float32)
    assert_rel_close(y, y_ref[:, :1000], 1e-5, f"{kernel} sorted down, N = 1000, {t} tokens")
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.shape[0], device="cuda")
    tok = t - 1
    xs1, order1, offsets1 = moe_permute(x[tok:], experts[tok:] % (EXPERTS if t < 64 else 40), EXPERTS)
    one = backend.mxfp4_grouped_gemm_gluon(xs1, w13, s13, offsets1, fuse_swiglu=True, swiglu_limit=LIMIT,
                                           row_scale=weights[tok:].flatten()[order1])  # fmt: skip
    assert_bitwise(one[torch.argsort(order1)], h[pos[tok * TOP_K : (tok + 1) * TOP_K]], f"{kernel}: token {tok} alone")


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("t", [8, 64, 300, 700])
def test_gpu_sorted_gluon_split(v41_experts, t, tma, monkeypatch):
    """The split dispatch uses on sm_90: skewed routing sends experts of every size class to the kernels (at 8
    and 64 tokens mma.sync <= SMALL_MMA_MAX_ROWS < Triton; at 300 and 700, over WGMMA_FROM_ROWS, mma.sync <=
    MMA_MAX_ROWS < wgmma <= WGMMA_MAX_ROWS < Triton, its gate/up tiles TALL_BLOCK_M rows tall (the threshold
    lowered to two rows an expert); with ``tma`` the TMA kernel instead of Triton at every size, TMA_FROM_ROWS
    lowered to 0); each the same bits when x is read through ``row_index`` (token-major x); a K the Gluon
    kernels do not serve goes to Triton (also through ``row_index``); with no rows for the Gluon kernels (and
    64-row tiles) every expert is in the Triton one, bitwise."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon as backend
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as triton_backend

    if tma and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is sm_90 only")
    monkeypatch.setattr(backend, "TALL_ROWS_PER_EXPERT", 2)  # tall from 2 E rows: 300 and 700 tokens
    monkeypatch.setattr(backend, "TMA_FROM_ROWS", 0 if tma else None)
    w13, s13, w2, s2 = v41_experts
    ref = reference("mxfp4_grouped_gemm")
    x, experts, weights = _tokens(t, seed=400 + t)
    experts = (experts.double() ** 2 / EXPERTS).long()  # expert e gets ~R / (2 sqrt(E e)) rows: every size class
    xs, order, offsets = moe_permute(x, experts, EXPERTS)
    if t >= 300:  # the tall tiles have experts to serve
        assert xs.shape[0] >= 2 * EXPERTS and int((offsets[1:] - offsets[:-1]).max()) > backend.WGMMA_MAX_ROWS
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order])
    h_ref = ref(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    h32 = backend.mxfp4_grouped_gemm_gluon(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    assert_rel_close(h32, h_ref, 1e-5, f"split gate/up, {t} tokens, skewed")
    h_idx = backend.mxfp4_grouped_gemm_gluon(x, w13, s13, offsets, row_index=order // TOP_K, **kw,
                                             out_dtype=torch.float32)  # fmt: skip
    assert_bitwise(h_idx, h32, f"split gate/up, {t} tokens, x through row_index")
    yk = backend.mxfp4_grouped_gemm_gluon(h32[:, :2240], w2[:, :, :1120], s2[:, :, :70], offsets)
    yk_ref = ref(h32[:, :2240], w2[:, :, :1120], s2[:, :, :70], offsets)
    assert_rel_close(yk, yk_ref.float(), 1e-2, f"gluon sorted, K = 2240 (Triton), {t} tokens")
    hk = h32[:, :2240][torch.argsort(order)]  # pair-major: row r of the sorted layout is pair order[r]
    yk_idx = backend.mxfp4_grouped_gemm_gluon(hk, w2[:, :, :1120], s2[:, :, :70], offsets, row_index=order)
    assert_bitwise(yk_idx, yk, f"gluon sorted, K = 2240 (Triton), {t} tokens, through row_index")
    monkeypatch.setattr(backend, "WGMMA_FROM_ROWS", 1 << 30)
    monkeypatch.setattr(backend, "SMALL_MMA_MAX_ROWS", 0)  # every expert in the Triton kernel's 64-row tiles
    monkeypatch.setattr(backend, "TALL_ROWS_PER_EXPERT", None)
    monkeypatch.setattr(backend, "TMA_FROM_ROWS", None)
    h_tr = backend.mxfp4_grouped_gemm_gluon(xs, w13, s13, offsets, **kw)
    assert_bitwise(h_tr, triton_backend.mxfp4_grouped_gemm_triton(xs, w13, s13, offsets, **kw), "no Gluon rows")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 300, 2048])
def test_gpu_sorted_tma(v41_experts, t):
    """The TMA kernel (sm_90) alone on every expert: uniform routing (2048 tokens: ~32 rows an expert, some over
    one 128-row tile) and skewed (an expert of hundreds of rows: several tiles; others of one or none), gate/up
    with the fused epilogue in bf16 and fp32, down in fp32; N not a multiple of the tile; against the reference;
    gate/up bitwise the same with token-major x read through the sort's row index (the relabelling gathers)."""
    from deepinfer_kernels.ops.grouped_gemm.triton import expert_out
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_tma as backend

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma and TMA: sm_90 only")
    w13, s13, w2, s2 = v41_experts
    ref = reference("mxfp4_grouped_gemm")
    x, experts, weights = _tokens(t, seed=500 + t)
    for skew in (False, True):
        ex = (experts.double() ** 2 / EXPERTS).long() if skew else experts
        xs, order, offsets = moe_permute(x, ex, EXPERTS)
        kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=weights.flatten()[order])
        h_ref = ref(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
        for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            h = backend.tma_rows_into(expert_out(xs.shape[0], w13, True, dt, "cuda"), xs, w13, s13, offsets,
                                      min_rows=0, **kw)  # fmt: skip
            assert_rel_close(h, h_ref, tol, f"tma gate/up {dt}, {t} tokens, skew {skew}")
        h_idx = backend.tma_rows_into(expert_out(xs.shape[0], w13, True, dt, "cuda"), x, w13, s13, offsets,
                                      min_rows=0, row_index=order // TOP_K, **kw)  # fmt: skip
        assert_bitwise(h_idx, h, f"tma gate/up, {t} tokens, skew {skew}, x through row_index")
        y_ref = ref(h, w2, s2, offsets, out_dtype=torch.float32)
        y = backend.tma_rows_into(expert_out(xs.shape[0], w2, False, torch.float32, "cuda"), h, w2, s2, offsets,
                                  min_rows=0)  # fmt: skip
        assert_rel_close(y, y_ref, 1e-5, f"tma down, {t} tokens, skew {skew}")
        y = backend.tma_rows_into(torch.zeros(xs.shape[0], 1000, device="cuda"), h, w2[:, :1000], s2[:, :1000],
                                  offsets, min_rows=0)  # fmt: skip
        assert_rel_close(y, y_ref[:, :1000], 1e-5, f"tma down, N = 1000, {t} tokens, skew {skew}")


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [16, 32, 64])
def test_gpu_sorted_tma_tails(v41_experts, tail):
    """The TMA kernel with each expert's last 1 .. ``tail`` rows past a full 128-row tile in tiles of ``tail``
    rows (``tma_rows_into(tail_rows=)``): experts of 1 .. 300 rows, some with tails in the list and some not,
    gate/up fused and down, against the reference; rows of experts under ``min_rows`` stay unwritten."""
    from deepinfer_kernels.ops.grouped_gemm.triton import expert_out
    from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule_ref
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import gluon_tma as backend

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma and TMA: sm_90 only")
    w13, s13, w2, s2 = v41_experts
    ref = reference("mxfp4_grouped_gemm")
    counts = torch.zeros(EXPERTS, dtype=torch.long)
    picked = [1, 20, 127, 128, 129, 130, 143, 144, 145, 160, 161, 191, 192, 200, 250, 256, 257, 300]
    counts[torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(tail))[: len(picked)]] = torch.tensor(picked)
    offsets = torch.zeros(EXPERTS + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    offsets = offsets.cuda()
    rows = int(counts.sum())
    spec = backend.tma_tile_specs(21, tail)[1]
    tails = expert_tile_schedule_ref(offsets, rows, *spec[:3], tail=spec.tail, tail_of=spec.tail_of)[0]
    assert int((tails >= 0).sum()) == sum(1 for c in picked if c > 128 and 0 < c % 128 <= tail), "tail tiles"
    g = torch.Generator(device="cuda").manual_seed(600 + tail)
    xs = torch.randn(rows, HIDDEN, device="cuda", generator=g).bfloat16()
    rs = torch.rand(rows, device="cuda", generator=g)
    kw = dict(fuse_swiglu=True, swiglu_limit=LIMIT, row_scale=rs)
    h_ref = ref(xs, w13, s13, offsets, **kw, out_dtype=torch.float32)
    big = torch.repeat_interleave(counts >= 21, counts).cuda()  # rows of the experts the kernel serves
    h = backend.tma_rows_into(torch.full((rows, INTER), -1.0, device="cuda"), xs, w13, s13, offsets, min_rows=21,
                              tail_rows=tail, **kw)  # fmt: skip
    assert_rel_close(h[big], h_ref[big], 1e-5, f"tma gate/up, tails of {tail}")
    assert bool((h[~big] == -1).all()), "rows of experts under min_rows written"
    h = h_ref.bfloat16()
    y_ref = ref(h, w2, s2, offsets, out_dtype=torch.float32)
    y = backend.tma_rows_into(expert_out(rows, w2, False, torch.float32, "cuda"), h, w2, s2, offsets, min_rows=0,
                              tail_rows=tail)  # fmt: skip
    assert_rel_close(y, y_ref, 1e-5, f"tma down, tails of {tail}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 2048])
def test_gpu_moe_experts_read_x_through_the_sort(v41_experts, t, monkeypatch):
    """The MoE's sorted layout (64 tokens: mma.sync and Triton tiles; 2048: every Gluon kernel and the TMA one
    with its tails) gives the same bits with x read through the sort's row tokens as from a sorted copy."""
    from deepinfer_kernels.ops import moe as moe_ops

    w13, s13, w2, s2 = v41_experts
    x, experts, weights = _tokens(t, seed=700 + t)
    experts = (experts.double() ** 2 / EXPERTS).long()  # experts of every size class
    w13q, w2q = moe_ops.Mxfp4Experts(w13, s13), moe_ops.Mxfp4Experts(w2, s2)
    got = moe_experts(x, experts, weights, w13q, w2q, swiglu_limit=LIMIT)
    monkeypatch.setattr(moe_ops, "MXFP4_X_BY_INDEX", False)
    assert_bitwise(got, moe_experts(x, experts, weights, w13q, w2q, swiglu_limit=LIMIT), f"{t} tokens")


@pytest.mark.gpu
def test_gpu_batch_invariant(v41_experts):
    """A token's rows alone (M = 1 token) equal its rows among 64 tokens, bitwise, in both layouts."""
    from deepinfer_kernels.ops.mxfp4_grouped_gemm import triton as backend

    w13, s13, _, _ = v41_experts
    x, experts, weights = _tokens(64, seed=7)
    xs, order, offsets = moe_permute(x, experts, EXPERTS)
    full = backend.mxfp4_grouped_gemm_triton(xs, w13, s13, offsets, fuse_swiglu=True, swiglu_limit=LIMIT)
    ids = experts.flatten()
    gfull = backend.mxfp4_grouped_gemm_gather_triton(x, w13, s13, ids, row_index=torch.arange(384, device="cuda") // 6,
                                                     fuse_swiglu=True, swiglu_limit=LIMIT)  # fmt: skip
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.shape[0], device="cuda")
    for tok in (0, 31, 63):
        xs1, order1, offsets1 = moe_permute(x[tok : tok + 1], experts[tok : tok + 1], EXPERTS)
        one = backend.mxfp4_grouped_gemm_triton(xs1, w13, s13, offsets1, fuse_swiglu=True, swiglu_limit=LIMIT)
        assert_bitwise(one[torch.argsort(order1)], full[pos[tok * 6 : tok * 6 + 6]], f"grouped token {tok}")
        g1 = backend.mxfp4_grouped_gemm_gather_triton(x[tok : tok + 1], w13, s13, ids[tok * 6 : tok * 6 + 6],
                                                      row_index=torch.zeros(6, dtype=torch.long, device="cuda"),
                                                      fuse_swiglu=True, swiglu_limit=LIMIT)  # fmt: skip
        assert_bitwise(g1, gfull[tok * 6 : tok * 6 + 6], f"gather token {tok}")

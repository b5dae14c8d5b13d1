"""fp8_gemm_nt (block-scaled FP8 GEMM) and the Triton act_quant_fp8.

(a) the reference against a float64 formulation written here (E4M3 bytes decoded through float64, scales
expanded by hand); (b) the Triton kernels under TRITON_INTERPRET=1 on small CPU shapes (child processes:
see ``deepinfer_kernels.testing.triton_interpreter``); (c) GPU tests at V4.1-Flash / V4-Flash shapes and the
batch-invariance of the ``triton_fixed`` backend (row r alone == row r among 64 rows, bitwise).
"""

from __future__ import annotations

import re

import pytest
import torch
from deepinfer_kernels.ops.fp8_gemm import fp8_gemm_nt
from deepinfer_kernels.ops.quant import act_quant_fp8, fp8_block_quantize
from deepinfer_kernels.registry import reference
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

E8M0 = torch.float8_e8m0fnu

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not importable")

# (N, K) of the V4.1-Flash dense projections (hidden 5120): wq_a, wq_b, wkv, wo_b, shared w1/w3, shared w2,
# indexer wq_b; all MXFP8 (block 32). V4-Flash (hidden 4096, 128x128 blocks): wq_a and the shared w2.
V41_SHAPES = [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (2304, 5120), (5120, 2304), (4096, 1280)]
V4_SHAPES = [(1024, 4096), (4096, 2048)]


def make_operands(m, n, k, block, scale_fmt, seed, device="cpu", a_scale_dtype=torch.float32):
    """Random activations and weights whose magnitudes vary by powers of two across scale blocks (so a
    scale applied to the wrong block shows), quantised with the quant ops (weight scales ``scale_fmt``, activation
    scales ``a_scale_dtype``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-3, 4, (m, k // block), generator=g).repeat_interleave(
        block, 1
    )
    gn = -(-n // block)
    wmag = 2.0 ** torch.randint(-6, 0, (gn, k // block), generator=g)
    w = torch.randn(n, k, generator=g) * wmag.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)
    a, sa = act_quant_fp8(x.to(device), block, a_scale_dtype)
    b, sb = fp8_block_quantize(w.to(device), (block, block), scale_fmt)
    return a, sa, b, sb


def gemm_float64(a, sa, b, sb, block):
    """Independent formulation: every factor decoded to float64 and expanded with explicit index maps."""
    from deepinfer_kernels.ops.quant.formats import ue8m0_bytes_to_float

    def f64(s):
        return ue8m0_bytes_to_float(s).double() if s.dtype in (torch.float8_e8m0fnu, torch.uint8) else s.double()

    m, k = a.shape
    n = b.shape[0]
    kk = torch.arange(k)
    a64 = a.double() * f64(sa)[:, kk // block]
    b64 = b.double() * f64(sb)[torch.arange(n)[:, None] // block, kk[None, :] // block]
    return a64 @ b64.T


# ---------------------------------------------------------------- (a) reference


@pytest.mark.parametrize("block,scale_fmt", [(128, "float"), (128, "ue8m0"), (32, "ue8m0")])
def test_reference_matches_float64(block, scale_fmt):
    a, sa, b, sb = make_operands(7, 80, 4 * block, block, scale_fmt, seed=block)
    got = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
    assert_rel_close(got, gemm_float64(a, sa, b, sb, block).float(), 1e-6, "reference vs float64")
    # the public entry point on CPU is the reference; bf16 output is the rounded fp32 one
    assert_bitwise(fp8_gemm_nt(a, sa, b, sb, block), got.to(torch.bfloat16), "public bf16")


def test_reference_leading_dims_and_uint8_scales():
    a, sa, b, sb = make_operands(6, 64, 256, 32, "ue8m0", seed=3)
    flat = fp8_gemm_nt(a, sa, b, sb, 32, torch.float32)
    got = fp8_gemm_nt(a.view(2, 3, 256), sa.view(2, 3, 8), b, sb.view(torch.uint8), 32, torch.float32)
    assert_bitwise(got.view(6, 64), flat, "leading dims / uint8 scales")


def test_validation():
    a, sa, b, sb = make_operands(2, 64, 256, 128, "ue8m0", seed=4)
    with pytest.raises(ValueError, match="block"):
        fp8_gemm_nt(a, sa, b, sb, 64)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm_nt(a, sa[:, :1], b, sb, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm_nt(a.float(), sa, b, sb, 128)


# ---------------------------------------------------------------- (b) Triton interpreter


def _interp_fp8_gemm(block: int, scale_fmt: str, m: int, n: int, k: int, a_ue8m0: bool = False) -> None:
    """Runs in a TRITON_INTERPRET=1 child: both Triton variants vs the reference on CPU tensors."""
    from deepinfer_kernels.ops.fp8_gemm import triton as backend

    a_dtype = E8M0 if a_ue8m0 else torch.float32
    a, sa, b, sb = make_operands(m, n, k, block, scale_fmt, seed=m + n + k, a_scale_dtype=a_dtype)
    print("config (fixed):", backend._config(None, n, k, block))
    ref32 = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
    for fn in (backend.fp8_gemm_nt_triton, backend.fp8_gemm_nt_triton_fixed):
        out = fn(a, sa, b, sb, block, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert_rel_close(out, ref32, 1e-2, f"{fn.__name__} bf16")
        assert_rel_close(fn(a, sa, b, sb, block, torch.float32), ref32, 1e-5, f"{fn.__name__} fp32")
    print("ok")


def _interp_bf16(block: int, m: int, n: int, k: int) -> None:
    """Runs in a TRITON_INTERPRET=1 child: the in-kernel dequant (bf16) kernel vs the reference, every K split
    up to one with an empty last part, a partial weight tile and scale block, 1 and 2 M tiles."""
    from deepinfer_kernels.ops.fp8_gemm import triton_bf16 as tb

    a, sa, b, sb = make_operands(m, n, k, block, "ue8m0", seed=m + n + k, a_scale_dtype=E8M0)
    ref = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
    steps = k // tb.BK
    for split in (1, 2, steps // 2 + 1):
        for block_m in (32, 64):
            cfg = dict(tb.bf16_config(m, n, k), split=split, BLOCK_M=block_m)
            got = tb.fp8_gemm_nt_triton_bf16(a, sa, b, sb, block, torch.float32, cfg=cfg)
            assert_rel_close(got, ref, 1e-5, f"bf16 kernel {m}x{n}x{k} block {block} split {split} BLOCK_M {block_m}")
    out = tb.fp8_gemm_nt_triton_bf16(a, sa.view(torch.uint8), b, sb.view(torch.uint8), block)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_rel_close(out, ref, 1e-2, "bf16 out, raw UE8M0 bytes")
    print("ok")


def _interp_act_quant(block: int, k: int) -> None:
    from deepinfer_kernels.ops.quant import triton as backend

    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, 2, k, generator=g) * 2.0 ** torch.randint(-20, 20, (3, 2, 1), generator=g)
    x[0, 0, :5] = 0.0  # zeros, a negative zero, and a whole zero block (the 1e-4 floor)
    x[0, 1, 3] = -0.0
    x[1, 1, :block] = 0.0
    x[2, 0, 7] = -1e-30 * x[2, 0].abs().max()  # rounds to -0
    for dtype in (torch.float32, torch.bfloat16):
        q, s = backend.act_quant_fp8_triton(x.to(dtype), block)
        q_ref, s_ref = reference("act_quant_fp8")(x.to(dtype), block)
        assert_bitwise(s, s_ref, f"scales {dtype}")
        assert_bitwise(q.view(torch.uint8), q_ref.view(torch.uint8), f"codes {dtype}")
        # UE8M0 scales: the same codes, the exponent bytes of the same powers of two
        q8, s8 = backend.act_quant_fp8_triton(x.to(dtype), block, torch.float8_e8m0fnu)
        assert s8.dtype == torch.float8_e8m0fnu and s8.shape == s.shape
        assert_bitwise(q8.view(torch.uint8), q_ref.view(torch.uint8), f"codes {dtype} (ue8m0 scales)")
        assert_bitwise(s8.view(torch.uint8), torch.log2(s_ref).to(torch.int32).add(127).to(torch.uint8), "bytes")
    print("ok")


INTERPRETED = {
    "gemm-128-ue8m0": ("_interp_fp8_gemm", (128, "ue8m0", 5, 96, 256)),
    "gemm-128-float-M70": ("_interp_fp8_gemm", (128, "float", 70, 64, 384)),
    "gemm-32-ue8m0-split4": ("_interp_fp8_gemm", (32, "ue8m0", 3, 80, 512)),  # K split in 4
    "gemm-32-ue8m0-M70-split4": ("_interp_fp8_gemm", (32, "ue8m0", 70, 64, 512)),  # 2 row tiles, K split in 4
    "gemm-32-ue8m0-act-ue8m0": ("_interp_fp8_gemm", (32, "ue8m0", 9, 64, 256, True)),  # the model's scales
    "bf16-32": ("_interp_bf16", (32, 40, 200, 384)),
    "bf16-128": ("_interp_bf16", (128, 3, 130, 512)),
    "act_quant-128": ("_interp_act_quant", (128, 256)),
    "act_quant-32-partial": ("_interp_act_quant", (32, 200)),
}


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
def test_triton_k_split_rule():
    """Up to 64 rows (and always for the batch-invariant variant) the K split comes from (N, K) alone; above, it
    counts the row tiles too, so it shrinks as M grows and is gone at prefill sizes."""
    from deepinfer_kernels.ops.fp8_gemm import triton as backend

    for n, k in V41_SHAPES:
        fixed = backend._config(None, n, k, 32)
        assert all(backend._config(m, n, k, 32) == fixed for m in (1, 17, 64))
        splits = [backend._config(m, n, k, 32)[2] for m in (65, 128, 256, 512, 1024, 4096)]
        assert splits == sorted(splits, reverse=True) and splits[0] <= fixed[2] and splits[-1] == 1, (n, k, splits)
    assert backend._config(256, 512, 5120, 32)[2] == 8  # wkv: 32 tiles, well under the SMs
    assert backend._config(128, 64, 512, 32)[2] == 4  # the interpreted M70 case: 2 tiles, 16 K blocks


# every case in one TRITON_INTERPRET=1 child process
test_triton_interpreted = needs_triton(interpreted_cases_test(__file__, INTERPRETED))


# ---------------------------------------------------------------- (c) GPU


def _backends():
    from deepinfer_kernels.ops.fp8_gemm import triton as backend

    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("block,shape", [(32, s) for s in V41_SHAPES] + [(128, s) for s in V4_SHAPES])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_gpu_real_shapes(block, shape, m):
    backend = _backends()
    n, k = shape
    a, sa, b, sb = make_operands(m, n, k, block, "ue8m0", seed=n * 7 + k + m, device="cuda")
    ref = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
    for fn in (backend.fp8_gemm_nt_triton, backend.fp8_gemm_nt_triton_fixed):
        assert_rel_close(fn(a, sa, b, sb, block, torch.bfloat16), ref, 1e-2, f"{fn.__name__} {m}x{n}x{k}")
        # Hopper's FP8 MMA accumulates inside one K-block with fewer than fp32's mantissa bits (measured
        # 4.7e-5 at K = 5120): the per-block fp32 promotion bounds it, hence 2e-4 rather than fp32's 1e-5
        assert_rel_close(fn(a, sa, b, sb, block, torch.float32), ref, 2e-4, f"{fn.__name__} fp32 {m}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("block,shape", [(32, (1280, 5120)), (32, (5120, 2304)), (128, (4096, 2048))])
def test_gpu_batch_invariant(block, shape):
    backend = _backends()
    n, k = shape
    a, sa, b, sb = make_operands(64, n, k, block, "ue8m0", seed=11, device="cuda")
    full = backend.fp8_gemm_nt_triton_fixed(a, sa, b, sb, block)
    for r in (0, 17, 63):
        one = backend.fp8_gemm_nt_triton_fixed(a[r : r + 1], sa[r : r + 1], b, sb, block)
        assert_bitwise(one[0], full[r], f"row {r} alone vs among 64")
    sub = backend.fp8_gemm_nt_triton_fixed(a[5:13], sa[5:13], b, sb, block)
    assert_bitwise(sub, full[5:13], "rows 5..12 among 8 vs among 64")


@pytest.mark.gpu
def test_gpu_registry_choice():
    from deepinfer_kernels.ops.fp8_gemm import gluon
    from deepinfer_kernels.registry import resolve, set_batch_invariant

    backend = _backends()
    try:
        set_batch_invariant(True)
        assert resolve("fp8_gemm_nt", "cuda") is backend.fp8_gemm_nt_triton_fixed
        set_batch_invariant(False)
        assert resolve("fp8_gemm_nt", "cuda") is gluon.fp8_gemm_nt_gluon
    finally:
        set_batch_invariant(None)


@pytest.mark.gpu
@pytest.mark.parametrize("step_k", [128, 256])
@pytest.mark.parametrize("shape", V41_SHAPES)
def test_gpu_gluon_decode_sizes(shape, step_k, monkeypatch):
    """The Gluon MXFP8 decode kernel against the reference at 1, 5, 8 and 16 rows (fp16 MMA of exact FP8 values,
    each K block's partial scaled in fp32: fp32 output within 1e-5), UE8M0 and float32 weight scales, N not a
    multiple of the 64-row tile, rows bitwise the same alone and among 16 (its tiling ignores M), steps of 128 and
    of 256 (``gluon.STEP_K``, 128 where K is no multiple of it); with the bf16 route on (BF16_MAX_M 256), 17 rows
    through it, 257 rows and block 128 through Triton (bitwise)."""
    from deepinfer_kernels.ops.fp8_gemm import gluon
    from deepinfer_kernels.ops.fp8_gemm.triton_bf16 import fp8_gemm_nt_triton_bf16

    monkeypatch.setattr(gluon, "STEP_K", step_k)
    monkeypatch.setattr(gluon, "BF16_MAX_M", 256)
    monkeypatch.setattr(gluon, "DEQUANT_MM_FROM_M", None)

    n, k = shape
    block = 32
    for scale_fmt, a_dtype in (("ue8m0", E8M0), ("ue8m0", torch.float32), ("float", torch.float32)):
        a, sa, b, sb = make_operands(16, n, k, block, scale_fmt, n + k + block, "cuda", a_scale_dtype=a_dtype)
        ref = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
        full = gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block, torch.float32)
        assert_rel_close(full, ref, 1e-5, f"gluon 16x{n}x{k} {scale_fmt}")
        for m in (1, 5, 8):
            got = gluon.fp8_gemm_nt_gluon(a[-m:], sa[-m:], b, sb, block, torch.float32)
            assert_bitwise(got, full[-m:], f"gluon: the last {m} rows alone vs among 16, {n}x{k}")
        bf = gluon.fp8_gemm_nt_gluon(a[:5], sa[:5], b, sb, block)
        assert_rel_close(bf, ref[:5], 1e-2, f"gluon bf16 out 5x{n}x{k}")
    n2 = n - 24  # a partial last tile (and scale block)
    got = gluon.fp8_gemm_nt_gluon(a[:3], sa[:3], b[:n2], sb[: -(-n2 // block)], block, torch.float32)
    assert_rel_close(got, ref[:3, :n2], 1e-5, f"gluon N = {n2}")
    m_big = gluon.BF16_MAX_M + 1
    a17, sa17, _, _ = make_operands(m_big, 8, k, block, "ue8m0", seed=3, device="cuda", a_scale_dtype=E8M0)
    _, _, b, sb = make_operands(1, n, k, block, "ue8m0", seed=5, device="cuda")
    got = gluon.fp8_gemm_nt_gluon(a17[:17], sa17[:17], b, sb, block, torch.float32)
    assert_bitwise(got, fp8_gemm_nt_triton_bf16(a17[:17], sa17[:17], b, sb, block, torch.float32), "17 rows: bf16")
    got = gluon.fp8_gemm_nt_gluon(a17, sa17, b, sb, block, torch.float32)
    assert_bitwise(got, _backends().fp8_gemm_nt_triton(a17, sa17, b, sb, block, torch.float32), f"{m_big}: Triton")
    a4, sa4, b4, sb4 = make_operands(4, 1024, 4096, 128, "float", seed=4, device="cuda")
    got = gluon.fp8_gemm_nt_gluon(a4, sa4, b4, sb4, 128)
    assert_bitwise(got, _backends().fp8_gemm_nt_triton(a4, sa4, b4, sb4, 128), "block 128: Triton")


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("block_scale,split,bk", [("ue8m0", 1, 128), ("float", 1, 128), ("ue8m0", 8, 128),
                                                  ("ue8m0", 8, 256)])  # fmt: skip
def test_gluon_kernel_compiles_for_sm90(block_scale, split, bk):
    """The decode kernel lowers for sm_90: FP8 weights and activations in 64-bit loads, a step's loads (4 or 8 K
    blocks) before its first MMA, converted by ``cvt.rn.f16x2.e4m3x2`` into fp16 ``mma.sync``, no spills; split
    along K, its tile's last program adds the parts (one acq_rel arrival a program, L2 loads of the parts), with
    no second launch."""
    pytest.importorskip("triton.experimental.gluon")
    import triton
    from deepinfer_kernels.ops.fp8_gemm import gluon
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {
        "a_ptr": "*fp8e4nv", "as_ptr": "*u8" if block_scale == "ue8m0" else "*fp32", "b_ptr": "*fp8e4nv",
        "bs_ptr": "*u8" if block_scale == "ue8m0" else "*fp32", "c_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "STEPS_PER_SPLIT": "i32",
    }  # fmt: skip
    e8m0 = block_scale == "ue8m0"  # the model's scales: UE8M0 on both sides
    meta = dict(A_E8M0=e8m0, B_E8M0=e8m0, BLOCK_N=gluon.BLOCK_N, NUM_WARPS=gluon.NUM_WARPS, SPLIT=split,
                SUM_IN_KERNEL=split > 1, BK=bk)  # fmt: skip
    sig.update(dict.fromkeys(meta, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)}  # as a launch specialises K % 16
    src = GluonASTSource(fn=gluon._fp8_rows_kernel, signature=sig, constexprs=meta, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": gluon.NUM_WARPS})
    ptx = kern.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    wide = [i for i, line in enumerate(ptx.splitlines()) if "ld.global.v2.b32" in line or "ld.global.b64" in line]
    first_mma = next(i for i, line in enumerate(ptx.splitlines()) if "mma.sync" in line)
    assert len(wide) >= 12 * bk // 128, "FP8 bytes in 64-bit loads"
    assert sum(i < first_mma for i in wide) >= 12 * bk // 128, "a step's loads all issued before its first MMA"
    assert ".local" not in ptx
    if split == 1:
        assert "atom" not in ptx and kern.metadata.shared == 0
    else:
        assert len(re.findall(r"atom\.global\.(gpu\.)?acq_rel(\.gpu)?\.add", ptx)) == 1, "one arrival a program"
        assert ".cg." in ptx, "the parts read from L2"


@pytest.mark.gpu
@pytest.mark.parametrize("block,shape", [(32, s) for s in V41_SHAPES] + [(128, s) for s in V4_SHAPES])
def test_gpu_triton_bf16_sizes(block, shape, monkeypatch):
    """The in-kernel dequant kernel (both operands exactly bf16, fp32 sums) against the reference within 1e-5 (fp32
    out) at 17-300 rows with its own tiling and K split, every BLOCK_M, an uneven and an over-long K split; bf16 out
    within 1e-2; a partial last weight tile. With the route on (BF16_MAX_M 512) the backend takes it for UE8M0
    scales (bitwise the same call) and leaves fp32 activation scales to the block-scaled Triton kernel."""
    from deepinfer_kernels.ops.fp8_gemm import gluon
    from deepinfer_kernels.ops.fp8_gemm import triton_bf16 as tb

    monkeypatch.setattr(gluon, "BF16_MAX_M", 512)
    n, k = shape
    ref_fn = reference("fp8_gemm_nt")
    for m in (17, 64, 200, 300):
        a, sa, b, sb = make_operands(m, n, k, block, "ue8m0", seed=n + k + m, device="cuda", a_scale_dtype=E8M0)
        ref = ref_fn(a, sa, b, sb, block, torch.float32)
        assert_rel_close(tb.fp8_gemm_nt_triton_bf16(a, sa, b, sb, block, torch.float32), ref, 1e-5, f"{m}x{n}x{k}")
    steps = k // tb.BK
    for block_m in (32, 64, 128):
        for split in (3, steps // 2 + 1):
            cfg = dict(tb.bf16_config(m, n, k), BLOCK_M=block_m, split=split)
            got = tb.fp8_gemm_nt_triton_bf16(a, sa, b, sb, block, torch.float32, cfg=cfg)
            assert_rel_close(got, ref, 1e-5, f"{m}x{n}x{k} BLOCK_M {block_m} split {split}")
    got = tb.fp8_gemm_nt_triton_bf16(a, sa, b, sb, block)
    assert_rel_close(got, ref, 1e-2, f"bf16 out {m}x{n}x{k}")
    assert_bitwise(gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block), got, "dispatch")
    n2 = n - 24
    got = tb.fp8_gemm_nt_triton_bf16(a[:40], sa[:40], b[:n2], sb[: -(-n2 // block)], block, torch.float32)
    assert_rel_close(got, ref[:40, :n2], 1e-5, f"N = {n2}")
    sa32 = sa.float()  # not UE8M0: the block-scaled kernel
    want = _backends().fp8_gemm_nt_triton(a, sa32, b, sb, block)
    assert_bitwise(gluon.fp8_gemm_nt_gluon(a, sa32, b, sb, block), want, "fp32 activation scales: Triton")


@pytest.mark.gpu
@pytest.mark.parametrize("block,shape", [(32, s) for s in V41_SHAPES[:4]] + [(128, s) for s in V4_SHAPES])
def test_gpu_dequant_mm(block, shape, monkeypatch):
    """Prefill sizes: both operands dequantised to bf16 (exact) and one cuBLAS GEMM, against the reference within
    1e-5 (fp32 out: exact products, fp32 sums) and 1e-2 (bf16 out); the backend chooses it (bitwise the same call)
    from DEQUANT_MM_FROM_M rows for the scale blocks of DEQUANT_MM_BLOCKS (by default 32 only: 128-blocks and 1026
    rows go to Triton)."""
    from deepinfer_kernels.ops.fp8_gemm import gluon
    from deepinfer_kernels.ops.fp8_gemm.dequant_mm import fp8_gemm_nt_dequant_mm

    monkeypatch.setattr(gluon, "DEQUANT_MM_FROM_M", 1027)
    n, k = shape
    m = 1027
    a, sa, b, sb = make_operands(m, n, k, block, "ue8m0", seed=n + k, device="cuda", a_scale_dtype=E8M0)
    ref = reference("fp8_gemm_nt")(a, sa, b, sb, block, torch.float32)
    assert_rel_close(fp8_gemm_nt_dequant_mm(a, sa, b, sb, block, torch.float32), ref, 1e-5, f"fp32 {m}x{n}x{k}")
    got = fp8_gemm_nt_dequant_mm(a, sa, b, sb, block)
    assert_rel_close(got, ref, 1e-2, f"bf16 {m}x{n}x{k}")
    triton_bits = _backends().fp8_gemm_nt_triton(a, sa, b, sb, block)
    assert_bitwise(gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block), got if block == 32 else triton_bits, "dispatch")
    assert_bitwise(gluon.fp8_gemm_nt_gluon(a[1:], sa[1:], b, sb, block), triton_bits[1:], "1026 rows: Triton")
    monkeypatch.setattr(gluon, "DEQUANT_MM_BLOCKS", (32, 128))
    assert_bitwise(gluon.fp8_gemm_nt_gluon(a, sa, b, sb, block), got, "dispatch, both blocks on")
    # fp32 scales need not be powers of two (bf16 would round their products): the Triton kernel serves them
    sa32 = sa.float()
    assert_bitwise(
        gluon.fp8_gemm_nt_gluon(a, sa32, b, sb, block), _backends().fp8_gemm_nt_triton(a, sa32, b, sb, block), "f32"
    )


@pytest.mark.skipif(not triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("block,block_m", [(32, 64), (32, 128), (128, 64)])
def test_bf16_kernel_compiles_for_sm90(block, block_m):
    """The in-kernel dequant kernel lowers for sm_90 to bf16 wgmma (weights converted in registers, both operands'
    loads pipelined with cp.async), without spills."""
    import triton
    from deepinfer_kernels.ops.fp8_gemm import triton_bf16 as tb
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        "x_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*u8", "c_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "STEPS_PER_SPLIT": "i32",
    }  # fmt: skip
    meta = dict(SB=block, BLOCK_M=block_m, BLOCK_N=tb.BLOCK_N, BK=tb.BK, F32_DOT=False, SPLIT=2, SUM_IN_KERNEL=True,
                PDL=True)  # fmt: skip
    sig.update(dict.fromkeys(meta, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8)}
    src = ASTSource(fn=tb._fp8_gemm_nt_bf16_kernel, signature=sig, constexprs=meta, attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    ptx = kern.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and ".bf16.bf16" in ptx
    # the converted weights are the A operand from registers (4 32-bit registers), the activations a descriptor
    assert re.search(r"wgmma\.mma_async\S*\.bf16\.bf16 \{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd", ptx)
    assert "cp.async" in ptx and "griddepcontrol.wait" in ptx
    assert ".local" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("block", [32, 128])
def test_gpu_act_quant_bitwise(block):
    from deepinfer_kernels.ops.quant import triton as qbackend

    g = torch.Generator().manual_seed(block)
    x = (torch.randn(300, 5120, generator=g) * 3).to(torch.bfloat16).cuda()
    q, s = qbackend.act_quant_fp8_triton(x, block)
    q_ref, s_ref = reference("act_quant_fp8")(x, block)
    assert_bitwise(s, s_ref, "scales")
    assert_bitwise(q.view(torch.uint8), q_ref.view(torch.uint8), "codes")


def _activation_operands(m, n, k, block, seed, device="cpu", scale_fmt="ue8m0"):
    """bf16 activations x [m, k] whose magnitudes vary by powers of two across blocks (a zero row and a tiny block
    included: the scale's floor) and e4m3 weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-8, 6, (m, k // block), generator=g).repeat_interleave(
        block, 1
    )
    x[0] = 0
    x[-1, :block] = 1e-30
    w = torch.randn(n, k, generator=g) / k**0.5
    b, sb = fp8_block_quantize(w.to(device), (block, block), scale_fmt)
    return x.to(device=device, dtype=torch.bfloat16), b, sb


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "float"])
def test_fp8_activations_forms_give_the_e4m3_bits(scale_fmt):
    """``quantize_fp8_activations`` / ``fp8_gemm_activations``: on the CPU the e4m3 form, ``fp8_gemm_nt`` of
    ``act_quant_fp8`` bitwise; the bf16 form (what prefill-size CUDA calls get) holds the same numbers
    (``fake_quant_fp8_ue8m0`` = the dequantised e4m3), and its GEMM is the dequant route's own call on them, so it
    has that route's bits (float weight scales: back to e4m3, the same bits as the e4m3 form)."""
    from deepinfer_kernels.ops.fp8_gemm import Fp8Activations, fp8_gemm_activations, quantize_fp8_activations
    from deepinfer_kernels.ops.fp8_gemm.dequant_mm import fp8_gemm_nt_dequant_mm
    from deepinfer_kernels.ops.quant import act_dequant_fp8, fake_quant_fp8_ue8m0

    block, (n, k) = 32, (96, 256)
    x, b, sb = _activation_operands(40, n, k, block, seed=3, scale_fmt=scale_fmt)
    act = quantize_fp8_activations(x, block)
    assert act.values is None and act.q.dtype == torch.float8_e4m3fn and act.scale.dtype == E8M0
    q, s = act_quant_fp8(x, block, E8M0)
    assert_bitwise(act.q.view(torch.uint8), q.view(torch.uint8), "e4m3 form: values")
    want = fp8_gemm_nt(q, s, b, sb, block)
    assert_bitwise(fp8_gemm_activations(act, b, sb), want, "e4m3 form: GEMM")
    values = fake_quant_fp8_ue8m0(x, block)
    assert_bitwise(values, act_dequant_fp8(q, s, block, torch.bfloat16), "bf16 form: the dequantised e4m3")
    got = fp8_gemm_activations(Fp8Activations(block, values=values), b, sb)  # bf16 out (CPU torch.mm has no fp32)
    if scale_fmt == "ue8m0":
        assert_bitwise(got, fp8_gemm_nt_dequant_mm(q, s, b, sb, block), "bf16 form: dequant route")
        assert_rel_close(got, reference("fp8_gemm_nt")(q, s, b, sb, block), 1e-2, "bf16 form: ref")
    else:
        assert_bitwise(got, fp8_gemm_nt(q, s, b, sb, block), "bf16 form, float scales: e4m3 route")
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemm_activations(Fp8Activations(block, values=values[:, :-block]), b, sb)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", V41_SHAPES[:4])
def test_gpu_fp8_activations_route(shape, monkeypatch):
    """On CUDA (bf16 x, 32-blocks): from DEQUANT_MM_FROM_M rows the bf16 form (one fake-quant launch instead of
    act_quant + the dequant route's act_dequant), bitwise ``fp8_gemm_nt(*act_quant_fp8(x))``; below it, in
    batch-invariant mode and with forced references the e4m3 form."""
    from deepinfer_kernels.ops.fp8_gemm import activations, fp8_gemm_activations, gluon, quantize_fp8_activations
    from deepinfer_kernels.registry import set_batch_invariant

    monkeypatch.setattr(activations, "BF16_FORM", True)
    monkeypatch.setattr(gluon, "DEQUANT_MM_FROM_M", 1027)
    n, k = shape
    x, b, sb = _activation_operands(1027, n, k, 32, seed=n + k, device="cuda")
    for rows, bf16_form in ((1027, True), (1026, False)):
        act = quantize_fp8_activations(x[:rows], 32)
        assert (act.values is not None) == bf16_form, rows
        want = fp8_gemm_nt(*act_quant_fp8(x[:rows], 32, E8M0), b, sb, 32)
        assert_bitwise(fp8_gemm_activations(act, b, sb), want, f"{rows} rows x {shape}")
    set_batch_invariant(True)
    try:
        assert quantize_fp8_activations(x, 32).values is None
    finally:
        set_batch_invariant(None)
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert quantize_fp8_activations(x, 32).values is None
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE")
    monkeypatch.setattr(activations, "BF16_FORM", False)
    assert quantize_fp8_activations(x, 32).values is None

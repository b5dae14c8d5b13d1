"""Gluon wide sparse MQA attention (``gluon.py``) vs the reference.

Gluon has no interpreter, so on the CPU the kernel is compiled for sm_90 (the cubin, not run): every tiling the
launcher can choose must lower (16-byte cp.async gathers, the two wgmma layouts) and fit the H200's shared memory.
On a Hopper GPU: V4 / V4.1 decode and prefill rows against the reference (padding, an all -1 row, ragged lists,
int32 indices, fp16, 128 heads, smaller head dims), two segments bitwise their concatenation, and the backend's
routing (the wide kernel from WIDE_MIN_ROWS queries, Triton's adaptive tiles below)."""

import os

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from deepinfer_kernels.ops.sparse_mqa_attention import gluon as wide  # noqa: E402
from deepinfer_kernels.ops.sparse_mqa_attention import triton as attn  # noqa: E402
from deepinfer_kernels.ops.sparse_mqa_attention.reference import sparse_mqa_attention_ref  # noqa: E402
from deepinfer_kernels.registry import batch_invariant, force_reference, resolve  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402

TOL = 1.5e-2  # bf16 / fp16 against the fp32 reference (P rounded to the KV dtype), as the Triton kernel's tests
SMEM_LIMIT = 227 * 1024  # the H200's shared memory per block


def _compile_sm90(d: int, block_n: int, num_buf: int | None, two: bool, dtype: torch.dtype, dup_s: bool = False):
    """The kernel compiled for sm_90 as its launch would specialise it (16-byte aligned pointers and strides)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    el = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    sig = {
        "q_ptr": f"*{el}", "kv_ptr": f"*{el}", "kv2_ptr": f"*{el}", "idx_ptr": "*i64", "sink_ptr": "*fp32",
        "o_ptr": f"*{el}", "K": "i32", "N1": "i32", "scale": "fp32", "q_st": "i32", "q_sh": "i32", "kv_s": "i32",
        "kv2_s": "i32", "idx_st": "i32", "o_st": "i32", "o_sh": "i32",
    }  # fmt: skip
    meta = dict(wide.wide_meta(d, dtype, block_n, num_buf, dup_s), TWO=two, PDL=True, num_warps=wide.WARPS)
    names = list(sig) + list(meta)
    sig.update(dict.fromkeys(meta, "constexpr"))
    aligned = [n for n in names[:16] if n not in ("K", "N1", "scale")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=wide._attn_wide_kernel, signature=sig, constexprs=meta, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": wide.WARPS})


@pytest.mark.parametrize(
    "d,block_n,num_buf,two,dtype,dup_s",
    [
        (512, 64, None, True, torch.bfloat16, False),  # the default at V4 / V4.1 shapes: 2 buffers of 64 entries
        (512, 64, None, True, torch.bfloat16, True),  # S made whole by both warpgroups
        (512, 32, None, False, torch.bfloat16, False),  # 4 buffers of 32 entries, one segment
        (128, 64, None, True, torch.float16, False),  # a smaller head dim: 4 buffers, 16 lanes a row
    ],
)
def test_kernel_compiles_for_sm90(d, block_n, num_buf, two, dtype, dup_s):
    compiled = _compile_sm90(d, block_n, num_buf, two, dtype, dup_s)
    ptx = compiled.asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx, "the gather on 16-byte cp.async"
    s_n = block_n if dup_s else block_n // 2  # a warpgroup's share of S, then its half of O's columns
    assert f"wgmma.mma_async.sync.aligned.m64n{s_n}k16" in ptx and f"m64n{d // 2}k16" in ptx, "S and O on wgmma"
    assert compiled.metadata.shared <= SMEM_LIMIT, f"{compiled.metadata.shared} bytes of shared memory"


def test_wide_meta_fits_the_buffers():
    for d in (64, 128, 256, 512):
        for block_n in (32, 64):
            meta = wide.wide_meta(d, torch.bfloat16, block_n)
            assert 2 <= meta["NUM_BUF"] <= 4
            used = wide.HEADS * d * 2 + meta["NUM_BUF"] * block_n * d * 2
            assert used <= wide.SMEM_BYTES or meta["NUM_BUF"] == 2, (d, block_n, meta["NUM_BUF"])
    assert wide.wide_meta(512, torch.bfloat16)["NUM_BUF"] == 2
    assert wide.wide_meta(512, torch.bfloat16, 32)["NUM_BUF"] == 4
    assert wide.wide_meta(512, torch.bfloat16, 32, num_buf=3)["NUM_BUF"] == 3


# ---- Hopper GPU ----------------------------------------------------------------------------------

H, D, WINDOW, TOPK = 64, 512, 128, 512


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


def _rows(t, n, k, seed, h=H, d=D, dtype=torch.bfloat16):
    """t queries over a pool of n rows: the last 128 rows before a random end (the window) + k - 128 random rows;
    row 0 has every third slot -1, row 1 a short list, row 2 only -1 (zeros out)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(t, h, d, generator=g, device="cuda").to(dtype)
    kv = torch.randn(n, d, generator=g, device="cuda").to(dtype)
    sinks = torch.randn(h, generator=g, device="cuda")
    ends = torch.randint(WINDOW, n, (t, 1), generator=g, device="cuda")
    window = ends - torch.arange(min(WINDOW, k), device="cuda")
    picked = torch.randint(0, n, (t, max(0, k - WINDOW)), generator=g, device="cuda")
    idx = torch.cat([window, picked], dim=1)
    if t >= 3:
        idx[0, ::3] = -1
        idx[1, 100:] = -1
        idx[2] = -1
    return q, kv, idx, sinks


def _check(out, q, kv, idx, sinks, scale, what, rows=16):
    sel = torch.arange(min(q.shape[0], rows), device="cuda")  # the reference is [rows, H, K, D] fp32
    ref = sparse_mqa_attention_ref(q[sel], kv, idx[sel], sinks, scale)
    assert_rel_close(out[sel].float(), ref.float(), TOL, what)
    if q.shape[0] >= 3:
        assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())), f"{what}: an all -1 row gives zeros"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("t", [1, 64, 256])
@pytest.mark.parametrize("k", [160, 640, 1000])  # V4 HCA at 4K, CSA / V4.1 sources, a ragged last step
@pytest.mark.parametrize("block_n,dup_s", [(64, False), (32, False), (64, True)])
def test_gpu_wide_matches_reference(t, k, block_n, dup_s):
    q, kv, idx, sinks = _rows(t, 32768, k, seed=t + k)
    out = wide.launch_wide(q, kv, idx, sinks, D**-0.5, block_n=block_n, dup_s=dup_s)
    _check(out, q, kv, idx, sinks, D**-0.5, f"T={t} K={k} BLOCK_N={block_n} DUP_S={dup_s}")
    last = torch.arange(max(0, t - 8), t, device="cuda")  # rows from the last programs too
    ref = sparse_mqa_attention_ref(q[last], kv, idx[last], sinks, D**-0.5)
    assert_rel_close(out[last].float(), ref.float(), TOL, f"T={t} K={k} last rows")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("h,d,dtype", [(128, 512, torch.bfloat16), (64, 128, torch.float16), (64, 64, torch.bfloat16)])
def test_gpu_wide_heads_dims_dtypes(h, d, dtype):
    q, kv, idx, sinks = _rows(70, 5000, 300, seed=h + d, h=h, d=d, dtype=dtype)
    out = wide.launch_wide(q, kv, idx.int(), sinks, d**-0.5)  # int32 indices
    _check(out, q, kv, idx, sinks, d**-0.5, f"H={h} D={d} {dtype}")


@pytest.mark.gpu
@hopper
def test_gpu_wide_two_segments_equal_one_pool():
    """Window rows of 64 requests and a paged pool read in place: bitwise the result over their concatenation."""
    q, pool, idx, sinks = _rows(64, 32768, 640, seed=9)
    window = torch.randn(64 * WINDOW, D, device="cuda").to(torch.bfloat16)
    idx[:, :WINDOW] = torch.arange(64, device="cuda")[:, None] * WINDOW + torch.arange(WINDOW, device="cuda")
    idx[:, WINDOW:] = torch.where(idx[:, WINDOW:] >= 0, idx[:, WINDOW:] + window.shape[0], -1)
    idx[2] = -1  # the window rows above overwrote _rows's all -1 row
    two = wide.launch_wide(q, (window, pool), idx, sinks, D**-0.5)
    assert_bitwise(two, wide.launch_wide(q, torch.cat([window, pool]), idx, sinks, D**-0.5), "two segments")
    _check(two, q, torch.cat([window, pool]), idx, sinks, D**-0.5, "two segments vs reference")


@pytest.mark.gpu
@hopper
def test_gpu_backend_routes_by_rows_and_matches_triton():
    """The default backend on Hopper; from WIDE_MIN_ROWS queries the wide kernel, below them triton_adaptive (the
    same bits); both near each other's results at V4.1 prefill rows."""
    if "DEEPINFER_BACKEND_SPARSE_MQA_ATTENTION" not in os.environ and not batch_invariant() and not force_reference():
        assert resolve("sparse_mqa_attention", "cuda") is wide.sparse_mqa_attention_gluon_adaptive
    q, kv, idx, sinks = _rows(wide.WIDE_MIN_ROWS - 1, 32768, 640, seed=3)
    assert_bitwise(
        wide.sparse_mqa_attention_gluon_adaptive(q, kv, idx, sinks, D**-0.5),
        attn.sparse_mqa_attention_triton_adaptive(q, kv, idx, sinks, D**-0.5),
        "below WIDE_MIN_ROWS: the Triton tiles",
    )
    q, kv, idx, sinks = _rows(4096, 8192, 640, seed=4)
    out = wide.sparse_mqa_attention_gluon_adaptive(q, kv, idx, sinks, D**-0.5)
    assert_bitwise(out, wide.launch_wide(q, kv, idx, sinks, D**-0.5), "prefill rows: the wide kernel")
    assert_rel_close(out.float(), attn.sparse_mqa_attention_triton_adaptive(q, kv, idx, sinks, D**-0.5).float(), TOL)
    _check(out, q, kv, idx, sinks, D**-0.5, "prefill")


@pytest.mark.gpu
@hopper
def test_gpu_wide_without_pdl_same_bits(monkeypatch):
    """``DEEPINFER_PDL=0`` launches the kernel without its PDL constexpr (it defaults off); same bits as with it."""
    from deepinfer_kernels.ops._triton_launch import PDL_ENV

    q, kv, idx, sinks = _rows(64, 8192, 640, seed=5)
    with_pdl = wide.launch_wide(q, kv, idx, sinks, D**-0.5)
    monkeypatch.setenv(PDL_ENV, "0")
    assert_bitwise(wide.launch_wide(q, kv, idx, sinks, D**-0.5), with_pdl, "PDL off vs on")

"""Triton sparse MQA attention vs the reference: the kernels under Triton's interpreter on CPU at
small shapes, and on CUDA at V4.1-Flash shapes (64 heads, head_dim 512, 128 window + 512 selected
entries per query, -1 padding) plus bitwise row invariance of the batch-invariant backend; kv as two
segments read in place (window rows + a paged pool) gives the bits of their concatenation."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.sparse_mqa_attention import triton as attn  # noqa: E402
from deepinfer_kernels.ops.sparse_mqa_attention.reference import sparse_mqa_attention_ref  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
BACKENDS = {"triton": attn.sparse_mqa_attention_triton, "triton_adaptive": attn.sparse_mqa_attention_triton_adaptive}


def _inputs(t, h, d, n, k, dtype, device, seed, pad=True):
    """Random q / pool / sinks and index rows of K slots: distinct pool rows, some rows -1 padded
    (a scattered pattern, a short row, an all-padding row), slots in random order."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(t, h, d, generator=g, device=device).to(dtype)
    kv = torch.randn(n, d, generator=g, device=device).to(dtype)
    sinks = torch.randn(h, generator=g, device=device)
    idx = torch.stack([torch.randperm(n, generator=g, device=device)[:k] for _ in range(t)])
    if pad and t >= 3:
        idx[0, ::3] = -1
        idx[1, 5:] = -1
        idx[2] = -1
    return q, kv, idx, sinks


def _interp_matches_reference(dtype: str, split: int | None, h: int, d: int) -> None:
    dt = getattr(torch, dtype)
    q, kv, idx, sinks = _inputs(5, h, d, 120, 70, dt, "cpu", seed=h + d)
    out = attn.launch(q, kv, idx, sinks, d**-0.5, split=split, block_h=16, block_n=16, num_warps=4)
    ref = sparse_mqa_attention_ref(q, kv, idx, sinks, d**-0.5)
    assert_rel_close(out.float(), ref.float(), TOL[dt], f"{dtype} split={split} h={h} d={d}")
    assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())), "an all -1 row gives zeros"


def _interp_int32_indices_backends_and_row_invariance() -> None:
    q, kv, idx, sinks = _inputs(6, 16, 64, 90, 48, torch.float32, "cpu", seed=7)
    out = attn.launch(q, kv, idx.int(), sinks, 0.125, split=32, block_h=16, block_n=16, num_warps=4)
    assert_rel_close(out, sparse_mqa_attention_ref(q, kv, idx, sinks, 0.125), 1e-5, "int32 indices")
    for r in (0, 4):
        alone = attn.launch(q[r : r + 1], kv, idx[r : r + 1], sinks, 0.125, split=32, block_h=16, block_n=16)
        assert_bitwise(alone[0], out[r], f"row {r}")
    for name, fn in BACKENDS.items():  # the registered entry points (their fixed tiles, 16 heads)
        assert_rel_close(fn(q, kv, idx, sinks, 0.125), out, 1e-5, name)


def _interp_two_segments_read_in_place() -> None:
    """kv as (first, second) segments: the same bits as one concatenated pool (the kernel reads the same rows),
    a segment that is a strided view (a pool's flat rows), both layouts of the split."""
    q, kv, idx, sinks = _inputs(5, 16, 64, 120, 70, torch.float32, "cpu", seed=3)
    pool = torch.randn(50, 2, 64)[:, 0]  # rows of stride 128: a view, as a pool's entries may be
    both = torch.cat([kv, pool])
    idx[3, ::2] = 120 + torch.arange(35) % 50  # rows of the second segment
    for split in (None, 32):
        one = attn.launch(q, both, idx, sinks, 0.125, split=split, block_h=16, block_n=16, num_warps=4)
        two = attn.launch(q, (kv, pool), idx, sinks, 0.125, split=split, block_h=16, block_n=16, num_warps=4)
        assert_bitwise(two, one, f"two segments split={split}")
        assert_rel_close(two, sparse_mqa_attention_ref(q, (kv, pool), idx, sinks, 0.125), 1e-5, "vs reference")


def _out_rope_is_the_op_after(device: str, dtype: torch.dtype, t: int, h: int, d: int, half: int, splits) -> None:
    """``out_rope`` (the inverse RoPE of the output's trailing 2 * half channels, in the kernel that stores it): the
    bits of the attention without it, then ``rope_interleaved(inverse=True)`` on its output, on both store paths
    (one pass: split None; split partials and their combine), and through the op's front end for every backend."""
    from deepinfer_kernels.ops.rope.triton import rope_interleaved_triton
    from deepinfer_kernels.ops.sparse_mqa_attention import sparse_mqa_attention

    q, kv, idx, sinks = _inputs(t, h, d, 300, 96, dtype, device, seed=d + half)
    g = torch.Generator(device=device).manual_seed(half)
    pos = torch.randint(0, 1_000_000, (t,), generator=g, device=device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, device=device).float() / (2 * half)))
    for split in splits:
        kw = dict(split=split, block_h=16, block_n=16, num_warps=4)
        plain = attn.launch(q, kv, idx, sinks, d**-0.5, **kw)
        want = rope_interleaved_triton(plain, pos, inv, inverse=True)
        got = attn.launch(q, kv, idx, sinks, d**-0.5, out_rope=(pos, inv), **kw)
        assert_bitwise(got, want, f"out_rope {dtype} split={split} d={d} half={half}")
    backends = dict(BACKENDS)
    if device == "cuda":
        from deepinfer_kernels.ops.sparse_mqa_attention import gluon

        if gluon._hopper():  # the default on Hopper: the Triton tiles below 64 queries, the wide kernel from there
            backends["gluon_adaptive"] = gluon.sparse_mqa_attention_gluon_adaptive
    for name, fn in backends.items():
        want = rope_interleaved_triton(fn(q, kv, idx, sinks, d**-0.5), pos, inv, inverse=True)
        assert_bitwise(fn(q, kv, idx, sinks, d**-0.5, out_rope=(pos, inv)), want, f"out_rope {name}")
    front = sparse_mqa_attention(q, kv, idx, sinks, d**-0.5, out_rope=(pos, inv))  # the dispatched backend
    assert_rel_close(front.float(), want.float(), TOL[dtype], "out_rope through the op")


def _interp_out_rope() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        _out_rope_is_the_op_after("cpu", dtype, 5, 20, 48, 8, (None, 32))
    _out_rope_is_the_op_after("cpu", torch.bfloat16, 3, 4, 64, 32, (None, 32))  # every channel rotated


INTERP_CASES = {
    f"{dt}-split{split}-h{h}-d{d}": ("_interp_matches_reference", (dt, split, h, d))
    for dt in ("float32", "bfloat16")
    for split in (None, 32)
    for h, d in ((4, 64), (20, 48))  # heads below / not a multiple of 16, odd D
}
INTERP_CASES["int32-backends-invariance"] = ("_interp_int32_indices_backends_and_row_invariance", ())
INTERP_CASES["two-segments"] = ("_interp_two_segments_read_in_place", ())
INTERP_CASES["out-rope"] = ("_interp_out_rope", ())


def test_out_rope_on_the_reference_backend():
    """Without a fusing backend (the reference on the CPU), the op applies the inverse RoPE after the attention; bad
    ``out_rope`` shapes are errors naming them."""
    from deepinfer_kernels.ops.rope import rope_interleaved
    from deepinfer_kernels.ops.sparse_mqa_attention import sparse_mqa_attention

    q, kv, idx, sinks = _inputs(4, 8, 64, 100, 32, torch.float32, "cpu", seed=1)
    pos, inv = torch.tensor([0, 5, 77, 123456]), torch.rand(16)
    want = rope_interleaved(sparse_mqa_attention_ref(q, kv, idx, sinks, 0.125), pos, inv, inverse=True)
    assert_bitwise(sparse_mqa_attention(q, kv, idx, sinks, 0.125, out_rope=(pos, inv)), want, "reference + rope")
    with pytest.raises(ValueError, match="out_rope wants positions"):
        sparse_mqa_attention(q, kv, idx, sinks, 0.125, out_rope=(pos[:3], inv))
    with pytest.raises(ValueError, match="out_rope wants positions"):
        sparse_mqa_attention(q, kv, idx, sinks, 0.125, out_rope=(pos, torch.rand(33)))


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


# ---- CUDA, V4.1-Flash shapes ----------------------------------------------------------------

H, D, WINDOW, TOPK = 64, 512, 128, 512


def _v41_rows(t, n, seed):
    """t query rows over a pool of n rows: 128 window slots (recent, contiguous) + 512 selected slots."""
    q, kv, _, sinks = _inputs(1, H, D, n, 1, torch.bfloat16, "cuda", seed, pad=False)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(t, H, D, generator=g, device="cuda").to(torch.bfloat16)
    ends = torch.randint(WINDOW, n, (t, 1), generator=g, device="cuda")
    window = ends - torch.arange(WINDOW, device="cuda")
    picked = torch.randint(0, n, (t, TOPK), generator=g, device="cuda")
    idx = torch.cat([window, picked], dim=1)
    idx[0, WINDOW + 100 :] = -1  # a short selection (fewer than 512 visible entries)
    return q, kv, idx, sinks


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_decode_matches_reference(backend, t):
    q, kv, idx, sinks = _v41_rows(t, 32768, seed=t)
    out = BACKENDS[backend](q, kv, idx, sinks, D**-0.5)
    rows = torch.arange(min(t, 16), device="cuda")  # reference memory is [rows, H, K, D] fp32
    ref = sparse_mqa_attention_ref(q[rows], kv, idx[rows], sinks, D**-0.5)
    assert_rel_close(out[rows].float(), ref.float(), TOL[torch.bfloat16], f"{backend} T={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 200])
def test_gpu_out_rope_is_the_op_after(t):
    """V4 / V4.1 shapes (64 heads of 512, the last 64 channels rotated): the fused inverse RoPE bitwise the RoPE
    kernel on the attention's output, on both store paths and through every Triton backend's tiles."""
    _out_rope_is_the_op_after("cuda", torch.bfloat16, t, H, D, 32, (None, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4, 16, 32])
@pytest.mark.parametrize("entries", [160, 640])
def test_gpu_adaptive_decode_tiles_match_reference(t, entries):
    """Each of ``decode_tile``'s small-batch choices (finer splits, 16 / 32 / 64 heads a program) at V4 / V4.1
    decode sizes: 128 window + 32 compressed entries (a 4K context at ratio 128), or 128 + 512 selected."""
    q, kv, idx, sinks = _v41_rows(t, 32768, seed=100 + t)
    idx = idx[:, :entries].contiguous()
    out = attn.sparse_mqa_attention_triton_adaptive(q, kv, idx, sinks, D**-0.5)
    ref = sparse_mqa_attention_ref(q, kv, idx, sinks, D**-0.5)
    assert_rel_close(
        out.float(), ref.float(), TOL[torch.bfloat16], f"adaptive T={t} K={entries} {attn.decode_tile(t, H, entries)}"
    )


def test_decode_tile_fills_the_gpu_when_it_can():
    """The small-batch rule: enough programs whenever some choice gives them, the least work a program otherwise;
    splits are whole 64-entry tiles shorter than the list."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    for t in (1, 2, 4, 8, 16, 32):
        for k in (48, 160, 384, 640, 2048):
            split, (bh, bn, warps, stages) = attn.decode_tile(t, 64, k)
            assert bh in attn.DECODE_HEADS and bn == 64 and stages == 1
            assert split is None or (split % 64 == 0 and split < k)
            programs = t * cdiv(64, bh) * (1 if split is None else cdiv(k, split))
            reachable = t * 4 * (cdiv(k, 64) if k > 64 else 1) >= attn.DECODE_PROGRAMS
            assert programs >= attn.DECODE_PROGRAMS or not reachable, (t, k, split, bh)
    assert attn.decode_tile(1, 64, 640) == (64, (16, 64, 4, 1))  # batch 1: 40 programs of one 64-entry tile
    assert attn.decode_tile(32, 64, 640) == (256, (64, 64, 8, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpu_prefill_matches_reference(backend):
    t = 4096
    q, kv, idx, sinks = _v41_rows(t, 8192, seed=11)
    out = BACKENDS[backend](q, kv, idx, sinks, D**-0.5)
    rows = torch.randperm(t, device="cuda")[:16]  # the reference is row-invariant: a subset suffices
    ref = sparse_mqa_attention_ref(q[rows], kv, idx[rows], sinks, D**-0.5)
    assert_rel_close(out[rows].float(), ref.float(), TOL[torch.bfloat16], f"{backend} prefill")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gpu_two_segments_equal_one_pool(backend):
    """Window rows of 64 requests [64 x 128, D] and a paged pool [32768, D] read in place: bitwise the result over
    their concatenation."""
    q, pool, idx, sinks = _v41_rows(64, 32768, seed=9)
    window = torch.randn(64 * WINDOW, D, device="cuda").to(torch.bfloat16)
    idx[:, :WINDOW] = torch.arange(64, device="cuda")[:, None] * WINDOW + torch.arange(WINDOW, device="cuda")
    idx[:, WINDOW:] = torch.where(idx[:, WINDOW:] >= 0, idx[:, WINDOW:] + window.shape[0], -1)
    fn = BACKENDS[backend]
    assert_bitwise(
        fn(q, (window, pool), idx, sinks, D**-0.5), fn(q, torch.cat([window, pool]), idx, sinks, D**-0.5), backend
    )


@pytest.mark.gpu
def test_gpu_row_invariance_of_the_invariant_backend():
    q, kv, idx, sinks = _v41_rows(64, 32768, seed=5)
    batch = attn.sparse_mqa_attention_triton(q, kv, idx, sinks, D**-0.5)
    for r in (0, 1, 31, 63):
        alone = attn.sparse_mqa_attention_triton(q[r : r + 1].clone(), kv, idx[r : r + 1].clone(), sinks, D**-0.5)
        assert_bitwise(alone[0], batch[r], f"row {r} alone vs in a batch of 64")
    big_q, _, big_idx, _ = _v41_rows(1024, 32768, seed=6)
    big_q[700], big_idx[700] = q[31], idx[31]
    assert_bitwise(attn.sparse_mqa_attention_triton(big_q, kv, big_idx, sinks, D**-0.5)[700], batch[31], "in 1024")

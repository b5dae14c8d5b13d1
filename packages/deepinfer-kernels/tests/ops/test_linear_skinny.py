"""The decode-size ``linear`` backend (``triton_skinny``) vs the reference: under Triton's interpreter on CPU at
small shapes (K split with the last-program fixup, one split, ragged N / K, 1-8 rows, fp32 output, fp16), and on
CUDA at the V4 / V4.1-Flash decode shapes it serves, with fresh random inputs; its determinism and the reset of its
counters (two runs and CUDA-graph replays give the same bits), its weight-stream tilings (wide weights: forced
tilings under the interpreter, the V4 / V4.1 wide projections on CUDA), its fallback to cuBLAS, and the registry's
choice."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.linear import triton_skinny as skinny  # noqa: E402
from deepinfer_kernels.ops.linear.cublas import linear_cublas  # noqa: E402
from deepinfer_kernels.ops.linear.reference import linear_ref  # noqa: E402
from deepinfer_kernels.registry import resolve, set_batch_invariant  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _pair(m, n, k, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return x, w


def _interp_matches_reference(dtype: str, m: int, n: int, k: int) -> None:
    dt = getattr(torch, dtype)
    x, w = _pair(m, n, k, dt, "cpu", seed=m * n + k)
    y = skinny.linear_skinny(x, w)
    assert y.dtype == dt and y.shape == (m, n)
    assert_rel_close(y, linear_ref(x, w), TOL[dt], f"{dtype} {m}x{n}x{k}")
    y32 = skinny.linear_skinny(x, w, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert_rel_close(y32, linear_ref(x.float(), w.float()), 1e-5, f"{dtype} -> fp32 {m}x{n}x{k}")
    assert_bitwise(skinny.linear_skinny(x, w, out_dtype=torch.float32), y32, "a second call (counters reset)")


INTERP_CASES = {
    f"{dt}-{m}x{n}x{k}": ("_interp_matches_reference", (dt, m, n, k))
    for dt, m, n, k in (
        ("bfloat16", 1, 64, 1536),  # three K splits of 512
        ("bfloat16", 8, 70, 1100),  # ragged N and last split, 8 rows
        ("bfloat16", 3, 40, 200),  # one split (no fixup)
        ("float16", 5, 33, 600),
    )
}


def _interp_stream_tiling(m: int, n: int, k: int, block_n: int, k_split: int) -> None:
    """A weight-stream tiling (wide column blocks, long K splits, the last one ragged) forced through ``cfg``."""
    x, w = _pair(m, n, k, torch.bfloat16, "cpu", seed=7 * m + n)
    tiling = skinny.Tiling(block_n, 64, k_split, -(-k // k_split), 4, 3)
    y = skinny.linear_skinny(x, w, cfg=tiling)
    assert_rel_close(y, linear_ref(x, w), TOL[torch.bfloat16], f"stream {m}x{n}x{k}")
    y32 = skinny.linear_skinny(x, w, out_dtype=torch.float32, cfg=tiling)
    assert_rel_close(y32, linear_ref(x.float(), w.float()), 1e-5, f"stream {m}x{n}x{k} -> fp32")


INTERP_CASES["stream-1x200x704"] = ("_interp_stream_tiling", (1, 200, 704, 128, 256))  # 3 splits, ragged N and K
INTERP_CASES["stream-8x128x300"] = ("_interp_stream_tiling", (8, 128, 300, 64, 512))  # one split
INTERP_CASES["short-stream-2x150x640"] = ("_interp_stream_tiling", (2, 150, 640, 64, 640))  # all of K, ragged N
test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


def test_config_and_what_it_serves():
    T = skinny.Tiling
    assert skinny.skinny_config(512, 4096) == T(32, 128, 512, 8)
    assert skinny.skinny_config(1280, 5120) == T(32, 128, 512, 10)
    assert skinny.skinny_config(2304, 5120) == T(64, 128, 512, 10)
    assert skinny.skinny_config(64, 200) == T(32, 128, 256, 1)
    # weight streams: 128-row blocks, even K splits of whole BLOCK_K steps, 4 stages with one split, 3 with several
    assert skinny.skinny_config(32768, 1024) == T(128, 128, 1024, 1, 4, 4)
    assert skinny.skinny_config(5120, 8192) == T(128, 128, 2048, 4, 4, 3)
    assert skinny.skinny_config(25600, 6144) == T(128, 128, 2048, 3, 4, 3)
    assert skinny.skinny_config(4096, 2304) == T(128, 128, 1152, 2, 4, 3)
    assert skinny.serves(8, 1280) and not skinny.serves(9, 64) and not skinny.serves(0, 64)
    assert skinny.serves(2, 2304) and not skinny.serves(3, 2304) and not skinny.serves(1, 2305)
    assert skinny.serves(8, 32768, 1024) and skinny.serves(1, 5120, 8192) and not skinny.serves(9, 32768, 1024)
    assert not skinny.serves(8, 4096, 2048) and not skinny.serves(1, 32768)  # under 32 MB, or K unknown: cuBLAS
    # short streams from a q_lora-rank input (the index query up-projections): 64-row blocks over all of K
    assert skinny.serves(1, 8192, 1024) and skinny.serves(8, 4096, 1280) and not skinny.serves(9, 8192, 1024)
    assert not skinny.serves(1, 4096, 1536) and not skinny.serves(1, 2560, 1024)  # K too long, or under 4M elements
    assert skinny.skinny_config(8192, 1024) == T(64, 128, 1024, 1, 4, 4)
    assert skinny.skinny_config(4096, 1280) == T(64, 128, 1280, 1, 4, 4)


# ---- CUDA: the decode shapes it serves (V4: K 4096; V4.1: K 5120) ----

SHAPES = [(4096, 1024), (4096, 512), (4096, 256), (4096, 64), (5120, 1280), (5120, 512), (5120, 384), (5120, 32)]
WIDE = [(4096, 2048), (5120, 2304)]  # served at batch 1-2 only
# weight streams: V4 / V4.1 q up-projections, output projections, V4.1's Engram values, the index q up-projections
STREAMS = [(1024, 32768), (8192, 4096), (1280, 32768), (8192, 5120), (6144, 25600), (1024, 8192), (1280, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gpu_matches_reference(m, k, n):
    x, w = _pair(m, n, k, torch.bfloat16, "cuda", seed=m + k + n)
    y = skinny.linear_skinny(x, w)
    assert_rel_close(y, linear_ref(x, w), TOL[torch.bfloat16], f"{m}x{n}x{k}")
    y32 = skinny.linear_skinny(x, w, out_dtype=torch.float32)
    assert_rel_close(y32, linear_ref(x.float(), w.float()), 1e-5, f"{m}x{n}x{k} -> fp32")
    for _ in range(3):  # the fixed split order: the same bits every time
        assert_bitwise(skinny.linear_skinny(x, w), y, "repeat")


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", WIDE)
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_wide_at_batch_one_and_two(m, k, n):
    x, w = _pair(m, n, k, torch.bfloat16, "cuda", seed=m + k + n)
    assert skinny.serves(m, n)
    assert_rel_close(skinny.linear_skinny(x, w), linear_ref(x, w), TOL[torch.bfloat16], f"{m}x{n}x{k}")
    y32 = skinny.linear_skinny(x, w, out_dtype=torch.float32)
    assert_rel_close(y32, linear_ref(x.float(), w.float()), 1e-5, f"{m}x{n}x{k} -> fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("k, n", STREAMS)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_gpu_weight_streams(m, k, n):
    x, w = _pair(m, n, k, torch.bfloat16, "cuda", seed=m + k + n)
    assert skinny.serves(m, n, k)
    y = skinny.linear_skinny(x, w)
    assert_rel_close(y, linear_ref(x, w), TOL[torch.bfloat16], f"{m}x{n}x{k}")
    assert_rel_close(skinny.linear_skinny(x, w, torch.float32), linear_ref(x.float(), w.float()), 1e-5, "fp32 out")
    assert_bitwise(skinny.linear_skinny(x, w), y, "repeat")


@pytest.mark.gpu
def test_gpu_graph_replays_and_fallbacks():
    x, w = _pair(4, 512, 4096, torch.bfloat16, "cuda", seed=3)
    eager = skinny.linear_skinny(x, w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny.linear_skinny(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny.linear_skinny(x, w)
    for _ in range(3):  # each replay leaves the counters at zero for the next one
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, eager, "graph replay")
    # more rows or a wide weight: cuBLAS, bitwise
    xs, wide = _pair(16, 4096, 4096, torch.bfloat16, "cuda", seed=4)
    assert_bitwise(skinny.linear_skinny(xs, w), linear_cublas(xs, w), "16 rows")
    assert_bitwise(skinny.linear_skinny(xs[:1], wide), linear_cublas(xs[:1], wide), "4096 x 4096: too small to stream")
    x32 = x.float()
    assert_bitwise(skinny.linear_skinny(x32, w.float()), linear_cublas(x32, w.float()), "fp32")


@pytest.mark.gpu
def test_gpu_registry():
    from deepinfer_kernels.ops.linear.triton import linear_triton_fixed

    assert resolve("linear", "cuda") is skinny.linear_skinny
    set_batch_invariant(True)
    try:
        assert resolve("linear", "cuda") is linear_triton_fixed
    finally:
        set_batch_invariant(None)

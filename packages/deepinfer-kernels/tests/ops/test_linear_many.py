"""``linear_many`` (several projections of one input): the public contract (each output is ``linear`` of its
weight, bad arguments named), and its one-launch backend (``triton_skinny``) against the reference under Triton's
interpreter on CPU (mixed bf16 / fp32 outputs, ragged N and K, 1-8 rows, one K split and several; 40-70 rows in the
mid-size tiling, several row blocks and K splits at once) and on CUDA at the V4 / V4.1-Flash decode sets it serves
(1-256 rows), with fresh random inputs; determinism, CUDA-graph replays (the shared arrival counters are left at
zero), the fallbacks to the per-weight loop, and the registry's choice."""

import pytest
import torch
from deepinfer_kernels import linear, linear_many
from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.ops.linear_many.reference import linear_many_loop, linear_many_ref
from deepinfer_kernels.registry import resolve, set_batch_invariant
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

F32 = torch.float32


def _set(m, k, ns, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    ws = [(torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype) for n in ns]
    return x, ws


def test_each_output_is_linear_of_its_weight():
    x, ws = _set(5, 96, [40, 7, 64], torch.bfloat16, "cpu", seed=1)
    outs = linear_many(x.view(5, 1, 96), ws, [None, F32, None])
    for o, w, dt in zip(outs, ws, [None, F32, None]):
        assert o.shape == (5, 1, w.shape[0]) and o.dtype == (dt or x.dtype)
        assert_bitwise(o, linear(x.view(5, 1, 96), w, dt), "linear of the same weight")
    assert [o.dtype for o in linear_many(x, ws)] == [torch.bfloat16] * 3  # out_dtypes=None: x.dtype
    x32 = x.float()  # an fp32 x computes in fp32 whatever was asked, like linear
    assert_bitwise(linear_many(x32, ws[:1], [F32])[0], linear(x32, ws[0]), "fp32 x")


def test_bad_arguments_are_named():
    x, ws = _set(2, 32, [8, 8], torch.bfloat16, "cpu", seed=2)
    with pytest.raises(ValueError, match="at least one weight"):
        linear_many(x, [])
    with pytest.raises(ValueError, match="2 weights but 1 out_dtypes"):
        linear_many(x, ws, [None])
    with pytest.raises(ValueError, match="weight 1 .* does not fit"):
        linear_many(x, [ws[0], ws[1][:, :16]])
    with pytest.raises(ValueError, match=r"out_dtypes\[0\] must be None or torch.float32"):
        linear_many(x, ws, [torch.float16, None])
    with pytest.raises(ValueError, match="floating-point"):
        linear_many(x.long(), ws)


# ---- the one-launch backend: Triton's interpreter on CPU ----


def _interp_matches_reference(dtype: str, m: int, k: int, ns: list, f32: list) -> None:
    from deepinfer_kernels.ops.linear_many import triton as many

    dt = getattr(torch, dtype)
    x, ws = _set(m, k, ns, dt, "cpu", seed=m + k + sum(ns))
    dts = [F32 if f else None for f in f32]
    assert many.serves(x, ws, dts)
    outs = many.linear_many_skinny(x, ws, dts)
    for i, (o, w, d) in enumerate(zip(outs, ws, dts)):
        assert o.dtype == (d or dt) and o.shape == (m, w.shape[0])
        want = linear_ref(x.float(), w.float()) if d else linear_ref(x, w)
        assert_rel_close(o, want, 1e-5 if d else 1e-2, f"{dtype} part {i} {m}x{w.shape[0]}x{k}")
    again = many.linear_many_skinny(x, ws, dts)  # the counters were reset: the same bits
    for o, a in zip(outs, again):
        assert_bitwise(a, o, "a second call")


INTERP_CASES = {
    f"{dt}-{m}x{k}-{'-'.join(map(str, ns))}": ("_interp_matches_reference", (dt, m, k, ns, f32))
    for dt, m, k, ns, f32 in (
        ("bfloat16", 1, 2200, [64, 33, 40], [False, True, True]),  # three K splits of 768, the last ragged; ragged N
        ("bfloat16", 8, 512, [32, 96], [True, False]),  # one split (no fixup), 8 rows
        ("float16", 3, 700, [8, 16, 24, 32, 40, 48, 56, 64], [i % 2 == 0 for i in range(8)]),  # all eight slots
        ("bfloat16", 70, 600, [100, 64], [False, True]),  # the mid-size tiling: 64-row tiles, a ragged second one
    )
}


def _interp_mid_forced(m: int, k: int, ns: list, block_m: int, k_split: int) -> None:
    """A mid-size tiling forced through ``cfg``: several row blocks and K splits at once, so each (row, column)
    block's counter and partials are its own (a shared counter would let one block add another's partials)."""
    from deepinfer_kernels.ops.linear_many import triton as many

    x, ws = _set(m, k, ns, torch.bfloat16, "cpu", seed=3 * m + k)
    dts = [F32, None]
    cfg = many.Tiling(32, 64, k_split, -(-k // k_split), 4, 2, block_m=block_m)
    outs = many.linear_many_skinny(x, ws, dts, cfg=cfg)
    for i, (o, w, d) in enumerate(zip(outs, ws, dts)):
        want = linear_ref(x.float(), w.float()) if d else linear_ref(x, w)
        assert_rel_close(o, want, 1e-5 if d else 1e-2, f"forced mid part {i} {m}x{w.shape[0]}x{k}")
    for o, a in zip(outs, many.linear_many_skinny(x, ws, dts, cfg=cfg)):
        assert_bitwise(a, o, "a second call")


INTERP_CASES["mid-forced-40x700"] = ("_interp_mid_forced", (40, 700, [48, 40], 16, 256))  # 3 row blocks, 3 splits


if triton_importable():  # every case in one TRITON_INTERPRET=1 child process
    test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


def test_tilings_and_what_it_serves():
    pytest.importorskip("triton")
    from deepinfer_kernels.ops.linear.triton_skinny import narrow_tiling
    from deepinfer_kernels.ops.linear_many import triton as many

    T = many.Tiling
    assert narrow_tiling(4096, many.BLOCK_N) == T(32, 128, 512, 8, block_m=16)
    assert narrow_tiling(200, many.BLOCK_N) == T(32, 128, 256, 1, block_m=16)
    # linear_many's own at decode rows: 1024-column splits, 3 stages
    assert many.decode_tiling(4096) == T(32, 128, 1024, 4, 4, 3, block_m=16)
    assert many.decode_tiling(5120) == T(32, 128, 1024, 5, 4, 3, block_m=16)
    assert many.decode_tiling(2200) == T(32, 128, 768, 3, 4, 3, block_m=16)
    assert many.decode_tiling(200) == T(32, 128, 256, 1, 4, 3, block_m=16)
    v4_csa = [1024, 512, 1024, 1024, 64, 256, 256]  # 65 column blocks of 64
    assert many.mid_tiling(16, v4_csa, 4096, 132) == T(64, 128, 2048, 2, 4, 3, block_m=64)  # 65 tiles: two K splits
    assert many.mid_tiling(128, v4_csa, 4096, 132) == T(64, 128, 4096, 1, 4, 3, block_m=64)  # 2 row blocks: 130 tiles
    assert many.mid_tiling(256, v4_csa, 4096, 132) == T(64, 128, 4096, 1, 4, 3, block_m=128)  # 130 tiles: one wave
    assert many.mid_tiling(9, [64], 4096, 132) == T(64, 128, 512, 8, 4, 3, block_m=64)  # splits of at least 512 columns
    assert many.mid_tiling(256, [1024, 512], 4096, 132) == T(64, 128, 4096, 1, 4, 3, block_m=64)  # 96 tiles of 64 rows
    meta = dict(device="meta", dtype=torch.bfloat16)
    x = lambda m: torch.empty(m, 4096, **meta)  # noqa: E731
    attn, shared = [torch.empty(n, 4096, **meta) for n in v4_csa], [torch.empty(2048, 4096, **meta)] * 2
    assert many.serves(x(256), attn, [None] * 7) and not many.serves(x(257), attn, [None] * 7)
    assert many.serves(x(8), shared, [None] * 2) and not many.serves(x(9), shared, [None] * 2)
    assert not many.serves(x(4).float(), attn, [None] * 7)  # fp32 x: the loop


# ---- CUDA: the decode sets the models use ----

SETS = {  # (K, [(N, fp32 out)]) of one normed input
    "v4 csa attention": (4096, [(1024, 0), (512, 0), (1024, 1), (1024, 1), (64, 0), (256, 1), (256, 1)]),
    "v4 hca attention": (4096, [(1024, 0), (512, 0), (512, 1), (512, 1)]),
    "v4 shared expert": (4096, [(2048, 1), (2048, 1)]),
    "v41 attention": (5120, [(1280, 0), (512, 0), (512, 1), (512, 1), (32, 0)]),
    "v41 shared expert": (5120, [(2304, 1), (2304, 1)]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SETS))
@pytest.mark.parametrize("m", [1, 3, 8, 16, 64, 100, 256])
def test_gpu_matches_reference(name, m):
    from deepinfer_kernels.ops.linear_many import triton as many

    k, parts = SETS[name]
    x, ws = _set(m, k, [n for n, _ in parts], torch.bfloat16, "cuda", seed=m + k)
    dts = [F32 if f else None for _, f in parts]
    if m > 8 and "shared" in name:  # 2048-2304-row weights past 8 rows: the per-weight loop
        assert not many.serves(x, ws, dts)
        return
    assert many.serves(x, ws, dts)
    outs = many.linear_many_skinny(x, ws, dts)
    want = linear_many_ref(x, ws, dts)
    for i, (o, r) in enumerate(zip(outs, want)):
        assert o.dtype == r.dtype
        assert_rel_close(o, r, 1e-5 if r.dtype == F32 else 1e-2, f"{name} part {i} at {m} rows")
    for _ in range(3):  # the fixed split order: the same bits every time
        for o, a in zip(outs, many.linear_many_skinny(x, ws, dts)):
            assert_bitwise(a, o, "repeat")


@pytest.mark.gpu
def test_gpu_graph_replays_fallbacks_and_registry():
    from deepinfer_kernels.ops.linear_many import triton as many

    k, parts = SETS["v4 csa attention"]
    x, ws = _set(4, k, [n for n, _ in parts], torch.bfloat16, "cuda", seed=5)
    dts = [F32 if f else None for _, f in parts]
    eager = many.linear_many_skinny(x, ws, dts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        many.linear_many_skinny(x, ws, dts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = many.linear_many_skinny(x, ws, dts)
    for _ in range(3):  # each replay leaves the counters at zero for the next one
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert_bitwise(o, e, "graph replay")
    # 257 rows, a weight past MAX_PART_N, nine weights: the per-weight loop, bitwise
    x257, _ = _set(257, k, [], torch.bfloat16, "cuda", seed=6)
    for args in ((x257, ws, dts), (x, ws + [ws[0].repeat(5, 1)], dts + [None]), (x, ws + ws[:2], dts + dts[:2])):
        assert not many.serves(*args)
        for o, r in zip(many.linear_many_skinny(*args), linear_many_loop(*args)):
            assert_bitwise(o, r, "fallback")
    assert resolve("linear_many", "cuda") is many.linear_many_skinny
    set_batch_invariant(True)
    try:
        assert resolve("linear_many", "cuda") is linear_many_loop
    finally:
        set_batch_invariant(None)

"""Triton rope_interleaved vs the reference: the kernel under Triton's interpreter on CPU at small shapes (in one
child process), and on CUDA at V4 shapes (queries [T, 64, 512], keys [T, 512], indexer queries [T, 64, 128],
R = 64, YaRN inv_freq, positions up to 1,000,000) with fresh random inputs, bitwise batch invariance, and the
registry's choice. Contract: pass-through channels bitwise, fp32 relative error <= 1e-6, bf16 within 1 ulp; on
CUDA the kernel is also held to bit-identity with the reference (measured so on an H200)."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.rope import YarnScaling, rope_interleaved, rope_inv_freq  # noqa: E402
from deepinfer_kernels.ops.rope.reference import rope_interleaved_ref  # noqa: E402
from deepinfer_kernels.ops.rope.triton import rope_interleaved_triton  # noqa: E402
from deepinfer_kernels.registry import resolve, set_batch_invariant  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

V4_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=65536)
MAX_POS = 1_000_000


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits as integers that are ordered like the values (the ulp distance is their difference)."""
    itype = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    i = t.view(itype).long()
    return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)


def max_ulp(actual: torch.Tensor, expected: torch.Tensor) -> int:
    return int((_ordered(actual) - _ordered(expected)).abs().max()) if actual.numel() else 0


def _check(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, inverse: bool, what: str) -> torch.Tensor:
    y = rope_interleaved_triton(x, pos, inv, inverse)
    ref = rope_interleaved_ref(x, pos, inv, inverse)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    r = 2 * inv.shape[0]
    assert_bitwise(y[..., :-r], x[..., :-r].contiguous(), f"{what}: pass-through channels")
    if x.dtype == torch.float32:
        assert_rel_close(y, ref, 1e-6, what)
    else:
        assert max_ulp(y, ref) <= 1, f"{what}: {max_ulp(y, ref)} ulp from the reference"
    return y


def _positions(t: int, device, g: torch.Generator) -> torch.Tensor:
    pos = torch.randint(0, MAX_POS + 1, (t,), generator=g, device=device)
    pos[0] = MAX_POS
    if t > 1:
        pos[1] = 0
    return pos


# ---- CPU, under the interpreter ----


def _interp_matches_reference(dtype: str, shape: tuple, rope_dim: int, inverse: bool) -> None:
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(shape, generator=g).mul(3).to(dt)
    inv = rope_inv_freq(rope_dim, 160000.0, V4_YARN)
    _check(x, _positions(shape[0], "cpu", g), inv, inverse, f"{dtype} {shape} R={rope_dim} inverse={inverse}")


def _interp_layouts_and_edges() -> None:
    g = torch.Generator().manual_seed(7)
    inv = rope_inv_freq(64, 10000.0)
    base = torch.randn(6, 5, 96, generator=g)
    pos = torch.tensor([3, 0, 999_999, 17, 65536, 1], dtype=torch.int32)  # int32 positions
    _check(base.transpose(0, 1).contiguous().transpose(0, 1), pos, inv, False, "strided heads")
    _check(base[:, ::2], pos, inv, True, "every other head")
    _check(base[..., :80], pos, inv, False, "row stride != D")
    _check(base.view(6, 5, 2, 48)[..., :40], pos, rope_inv_freq(24, 10000.0), False, "4-D, R = 24 (not a power of 2)")
    _check(base[:, 0, :64], pos, inv, False, "R = D (no pass-through)")
    assert rope_interleaved_triton(base[:0], pos[:0], inv).shape == (0, 5, 96)
    # inverse undoes the rotation (to rounding) and a row's bits do not depend on the other rows
    y = rope_interleaved_triton(base, pos, inv)
    assert_rel_close(rope_interleaved_triton(y, pos, inv, inverse=True), base, 1e-6, "round trip")
    for r in (0, 2, 5):
        assert_bitwise(rope_interleaved_triton(base[r : r + 1].clone(), pos[r : r + 1], inv)[0], y[r], f"row {r}")


def _interp_out() -> None:
    """``out=x`` rotates in place (the leading channels untouched, not even rewritten); another ``out``, strided,
    receives the same values as the out-of-place call."""
    g = torch.Generator().manual_seed(9)
    inv = rope_inv_freq(16, 160000.0, V4_YARN)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 5, 48, generator=g).mul(3).to(dt)
        pos = _positions(6, "cpu", g)
        for inverse in (False, True):
            want = rope_interleaved_triton(x, pos, inv, inverse)
            y = x.clone()
            assert rope_interleaved_triton(y, pos, inv, inverse, out=y) is y
            assert_bitwise(y, want, f"{dt} in place inverse={inverse}")
            strided = torch.full((6, 5, 64), float("nan"), dtype=dt)[..., 8:56]
            rope_interleaved_triton(x, pos, inv, inverse, out=strided)
            assert_bitwise(strided, want, f"{dt} strided out inverse={inverse}")
            # in place on a view whose heads are strided ([T, H, D] view exists): only the tail moves
            big = torch.randn(6, 10, 48, generator=g).to(dt)
            view, keep = big[:, ::2], big[:, 1::2].clone()
            want = rope_interleaved_triton(view, pos, inv, inverse)
            rope_interleaved_triton(view, pos, inv, inverse, out=view)
            assert_bitwise(view, want, f"{dt} in place, strided heads")
            assert_bitwise(big[:, 1::2], keep, f"{dt} in place leaves the other heads alone")


INTERP_CASES = {
    f"{dt}-{'x'.join(map(str, s))}-r{r}-{'inv' if i else 'fwd'}": ("_interp_matches_reference", (dt, s, r, i))
    for dt in ("float32", "bfloat16")
    for s, r in (((3, 4, 96), 64), ((5, 72), 64), ((2, 3, 2, 80), 16))
    for i in (False, True)
}
INTERP_CASES["layouts-and-edges"] = ("_interp_layouts_and_edges", ())
INTERP_CASES["out"] = ("_interp_out", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


def test_registered_for_cuda_only():
    from deepinfer_kernels.registry import list_ops

    assert "triton" in list_ops()["rope_interleaved"]
    assert resolve("rope_interleaved", "cpu") is rope_interleaved_ref


# ---- CUDA, real shapes ----

SHAPES = {"q": (64, 512), "kv": (512,), "indexer_q": (64, 128)}  # middle dims + D of each call site


@pytest.mark.gpu
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("site", list(SHAPES))
@pytest.mark.parametrize("t", [1, 7, 4096])
def test_gpu_matches_reference(t, site, dtype, inverse):
    g = torch.Generator(device="cuda").manual_seed(t + len(site))
    x = torch.randn(t, *SHAPES[site], generator=g, device="cuda").mul(4).to(dtype)
    inv = rope_inv_freq(64, 160000.0, V4_YARN).cuda()
    _check(x, _positions(t, "cuda", g), inv, inverse, f"{site} T={t} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("site", list(SHAPES))
def test_gpu_batch_invariant(site, dtype):
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(4096, *SHAPES[site], generator=g, device="cuda").to(dtype)
    pos = _positions(4096, "cuda", g)
    inv = rope_inv_freq(64, 160000.0, V4_YARN).cuda()
    full = rope_interleaved_triton(x, pos, inv)
    for r in (0, 1, 2500, 4095):
        one = rope_interleaved_triton(x[r : r + 1].clone(), pos[r : r + 1].clone(), inv)
        assert_bitwise(one[0], full[r], f"row {r} alone vs in 4096")
    assert_bitwise(rope_interleaved_triton(x[3:10], pos[3:10], inv), full[3:10], "rows 3..9 among 7 vs 4096")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_bitwise_vs_reference(dtype):
    """libdevice cos / sin, no FMA contraction: expected bit-identical to the reference (same fp32 roundings)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4096, 64, 512, generator=g, device="cuda").to(dtype)
    pos = _positions(4096, "cuda", g)
    for inv in (rope_inv_freq(64, 160000.0, V4_YARN).cuda(), rope_inv_freq(64, 10000.0).cuda()):
        for inverse in (False, True):
            got = rope_interleaved_triton(x, pos, inv, inverse)
            assert_bitwise(got, rope_interleaved_ref(x, pos, inv, inverse), f"{dtype} inverse={inverse}")


def test_reference_out():
    """The op's ``out=``: in place (``out=x``) and into another tensor equal the out-of-place result (reference)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 40, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 70000, (5,), generator=g)
    inv = rope_inv_freq(16, 160000.0, V4_YARN)
    want = rope_interleaved(x, pos, inv, True)
    y = x.clone()
    assert rope_interleaved(y, pos, inv, True, out=y) is y
    assert_bitwise(y, want, "in place")
    other = torch.empty_like(x)
    assert_bitwise(rope_interleaved(x, pos, inv, True, out=other), want, "into another tensor")
    with pytest.raises(ValueError, match="out"):
        rope_interleaved(x, pos, inv, out=torch.empty(5, 3, 40))


@pytest.mark.gpu
@pytest.mark.parametrize("site", list(SHAPES))
def test_gpu_in_place(site):
    """``out=x`` on CUDA at the call-site shapes: bit-identical to the out-of-place kernel and the reference."""
    g = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(4096, *SHAPES[site], generator=g, device="cuda").to(torch.bfloat16)
    pos = _positions(4096, "cuda", g)
    inv = rope_inv_freq(64, 160000.0, V4_YARN).cuda()
    for inverse in (False, True):
        want = rope_interleaved_triton(x, pos, inv, inverse)
        y = x.clone()
        rope_interleaved_triton(y, pos, inv, inverse, out=y)
        assert_bitwise(y, want, f"{site} in place inverse={inverse}")
        assert_bitwise(y, rope_interleaved_ref(x, pos, inv, inverse), f"{site} in place vs reference")


@pytest.mark.gpu
def test_gpu_registry(monkeypatch):
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE", raising=False)
    assert resolve("rope_interleaved", "cuda") is rope_interleaved_triton
    set_batch_invariant(True)
    try:
        assert resolve("rope_interleaved", "cuda") is rope_interleaved_triton
    finally:
        set_batch_invariant(None)
    x = torch.randn(7, 64, 512, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(100, 107, device="cuda")
    inv = rope_inv_freq(64, 160000.0, V4_YARN).cuda()
    assert_bitwise(rope_interleaved(x, pos, inv), rope_interleaved_triton(x, pos, inv), "public op on CUDA")
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert resolve("rope_interleaved", "cuda") is rope_interleaved_ref

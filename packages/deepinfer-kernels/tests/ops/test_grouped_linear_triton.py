"""GPU backends of ``grouped_linear`` vs the reference: the batch-invariant grouped Triton kernel under Triton's
interpreter on CPU at small shapes (ragged tiles, a K split, strided x, fp32 IEEE and bf16), and both backends
(``cublas``, ``triton_fixed``) on CUDA at V4's ``wo_a`` shape (G = 8, Din = 4096, Dout = 1024, bf16) with fresh
random inputs, bitwise row invariance of ``triton_fixed`` (one row alone, inside 64, inside 4096) and the
registry's choice."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.grouped_linear import grouped_linear  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.cublas import grouped_linear_cublas  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.reference import grouped_linear_ref  # noqa: E402
from deepinfer_kernels.ops.grouped_linear.triton import grouped_linear_triton_fixed  # noqa: E402
from deepinfer_kernels.registry import list_ops, resolve, set_batch_invariant  # noqa: E402
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# ---- CPU, under the interpreter ----


def _interp_matches_reference(dtype: str, m: int, g: int, n: int, k: int) -> None:
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, g, k, generator=gen).to(dt)
    w = (torch.randn(g * n, k, generator=gen) / k**0.5).to(dt)
    y = grouped_linear_triton_fixed(x, w)
    assert y.dtype == dt and y.shape == (m, g, n)
    assert_rel_close(y, grouped_linear_ref(x, w), TOL[dt], f"{dtype} {m}x{g}x{n}x{k}")
    for r in {0, m // 2, m - 1}:
        assert_bitwise(grouped_linear_triton_fixed(x[r : r + 1].clone(), w)[0], y[r], f"row {r} alone vs in {m}")


def _interp_strided_bf16_weight_and_empty() -> None:
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(6, 3, 2, 96, generator=gen)
    x = big[:, :, 0]  # [6, 3, 96] with row stride 576 and group stride 192
    w = torch.randn(3 * 40, 96, generator=gen).to(torch.bfloat16)  # cast to x's dtype, as the reference does
    assert_rel_close(grouped_linear_triton_fixed(x, w), grouped_linear_ref(x, w), 1e-5, "strided x, bf16 weight")
    assert grouped_linear_triton_fixed(x[:0], w).shape == (0, 3, 40)


INTERP_CASES = {
    f"{dt}-{m}x{g}x{n}x{k}": ("_interp_matches_reference", (dt, m, g, n, k))
    for dt in ("float32", "bfloat16")
    for m, g, n, k in ((1, 2, 64, 1024), (5, 3, 40, 100), (70, 2, 130, 200))  # K split; ragged N, K and M tiles
}
INTERP_CASES["strided-bf16-weight-empty"] = ("_interp_strided_bf16_weight_and_empty", ())


test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)  # every case in one TRITON_INTERPRET=1 child process


def test_registered_for_cuda_only():
    assert {"cublas", "triton_fixed"} <= set(list_ops()["grouped_linear"])
    assert resolve("grouped_linear", "cpu") is grouped_linear_ref


# ---- CUDA, V4 wo_a: G = 8 groups of 4096 -> 1024, bf16 ----

G, DIN, DOUT = 8, 4096, 1024


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, G, DIN, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(G * DOUT, DIN, generator=gen, device="cuda") / DIN**0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 4096])
def test_gpu_matches_reference(t):
    x, w = _inputs(t, seed=t)
    ref = grouped_linear_ref(x, w)
    assert_rel_close(grouped_linear_cublas(x, w), ref, TOL[torch.bfloat16], f"cublas T={t}")
    assert_rel_close(grouped_linear_triton_fixed(x, w), ref, TOL[torch.bfloat16], f"triton_fixed T={t}")


@pytest.mark.gpu
def test_gpu_fp32_and_strided():
    x, w = _inputs(64, seed=3)
    xf = x.float()
    assert_rel_close(grouped_linear_triton_fixed(xf, w), grouped_linear_ref(xf, w), TOL[torch.float32], "fp32")
    wide = torch.randn(16, G, 2 * DIN, device="cuda", dtype=torch.bfloat16)[..., :DIN]  # row stride 2 * G * DIN
    ref = grouped_linear_ref(wide, w)
    assert_rel_close(grouped_linear_cublas(wide, w), ref, TOL[torch.bfloat16], "cublas strided")
    assert_rel_close(grouped_linear_triton_fixed(wide, w), ref, TOL[torch.bfloat16], "triton_fixed strided")


@pytest.mark.gpu
def test_gpu_triton_fixed_row_invariant():
    x, w = _inputs(64, seed=1)
    y = grouped_linear_triton_fixed(x, w)
    for r in (0, 17, 63):
        assert_bitwise(grouped_linear_triton_fixed(x[r : r + 1].clone(), w)[0], y[r], f"row {r} alone vs in 64")
    assert_bitwise(grouped_linear_triton_fixed(x[8:16], w), y[8:16], "rows 8..15 among 8 vs among 64")
    big, _ = _inputs(4096, seed=2)
    big[4000] = x[17]
    assert_bitwise(grouped_linear_triton_fixed(big, w)[4000], y[17], "row inside a batch of 4096")


@pytest.mark.gpu
def test_gpu_registry(monkeypatch):
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE", raising=False)
    assert resolve("grouped_linear", "cuda") is grouped_linear_cublas
    set_batch_invariant(True)
    try:
        assert resolve("grouped_linear", "cuda") is grouped_linear_triton_fixed
    finally:
        set_batch_invariant(None)
    x, w = _inputs(8, seed=4)
    assert_bitwise(grouped_linear(x, w), grouped_linear_cublas(x, w), "public op on CUDA")
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert resolve("grouped_linear", "cuda") is grouped_linear_ref

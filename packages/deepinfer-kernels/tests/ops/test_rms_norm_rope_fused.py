"""rms_norm_rope: the reference is rope_interleaved_ref after rms_norm_ref; the Triton kernel (under the interpreter
on CPU at small shapes, on CUDA at the V4 / V4.1 call-site shapes) is bitwise the Triton rms_norm followed by the
Triton rope_interleaved, and close to the reference; with out / out_rows the same rows land in a table (rows scattered,
negative rows skipped, the rest of the table untouched); argument checks and the registry's choice."""

import pytest
import torch
from deepinfer_kernels import rms_norm_rope, rope_inv_freq
from deepinfer_kernels.ops.rms_norm.reference import rms_norm_ref
from deepinfer_kernels.ops.rms_norm_rope.reference import rms_norm_rope_ref
from deepinfer_kernels.ops.rope.reference import rope_interleaved_ref
from deepinfer_kernels.registry import resolve
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test, triton_importable

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(shape, rope_dim, weighted, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device) * 3).to(dtype)
    w = 1 + 0.2 * torch.randn(shape[-1], generator=g, device=device) if weighted else None
    pos = torch.randint(0, 1_000_001, (shape[0],), generator=g, device=device)
    pos[0] = 1_000_000
    return x, w, pos, rope_inv_freq(rope_dim, 10000.0).to(device)


def test_reference_is_the_two_references():
    x, w, pos, inv = _inputs((5, 3, 48), 16, True, torch.float32, "cpu", 1)
    want = rope_interleaved_ref(rms_norm_ref(x, w, 1e-6), pos, inv)
    assert_bitwise(rms_norm_rope_ref(x, w, 1e-6, pos, inv), want, "reference")
    assert_bitwise(rms_norm_rope(x, w, 1e-6, pos, inv), want, "dispatch on the CPU")


def _table_case(x, n, seed):
    """A table of n rows holding other values, and x's rows scattered over it (the last row of x skipped)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn((n, *x.shape[1:]), generator=g).to(x.dtype).to(x.device)
    rows = torch.randperm(n, generator=g)[: x.shape[0]].to(x.device)
    rows[-1] = -1
    return table, rows


def _expect_rows(table, y, rows):
    want = table.clone()
    keep = rows >= 0
    want[rows[keep]] = y[keep]
    return want


def test_reference_out_rows_scatters_the_result():
    x, w, pos, inv = _inputs((5, 3, 48), 16, True, torch.float32, "cpu", 3)
    table, rows = _table_case(x, 9, 3)
    want = _expect_rows(table, rms_norm_rope_ref(x, w, 1e-6, pos, inv), rows)
    got = rms_norm_rope(x, w, 1e-6, pos, inv, out=table, out_rows=rows)
    assert got is table
    assert_bitwise(table, want, "reference with out / out_rows")


def test_checks_arguments():
    x, w, pos, inv = _inputs((4, 32), 16, True, torch.float32, "cpu", 2)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_rope(x, w[:-1], 1e-6, pos, inv)
    with pytest.raises(ValueError, match="positions"):
        rms_norm_rope(x, w, 1e-6, pos[:-1], inv)
    with pytest.raises(ValueError, match="rope dim"):
        rms_norm_rope(x, w, 1e-6, pos, rope_inv_freq(64, 10000.0))
    rows = torch.arange(4)
    with pytest.raises(ValueError, match="go together"):
        rms_norm_rope(x, w, 1e-6, pos, inv, out=torch.zeros(8, 32))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        rms_norm_rope(x, w, 1e-6, pos, inv, out=torch.zeros(8, 32, dtype=torch.bfloat16), out_rows=rows)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        rms_norm_rope(x, w, 1e-6, pos, inv, out=torch.zeros(32, 8).t(), out_rows=rows)
    with pytest.raises(ValueError, match="out_rows must be"):
        rms_norm_rope(x, w, 1e-6, pos, inv, out=torch.zeros(8, 32), out_rows=rows.float())


def _check(x, w, pos, inv, eps, what):
    """The fused kernel against the two Triton ops (bitwise) and the reference (close); its out / out_rows form
    stores the same rows into a table (bitwise)."""
    from deepinfer_kernels.ops.rms_norm.triton import rms_norm_triton
    from deepinfer_kernels.ops.rms_norm_rope.triton import rms_norm_rope_triton
    from deepinfer_kernels.ops.rope.triton import rope_interleaved_triton

    got = rms_norm_rope_triton(x, w, eps, pos, inv)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_bitwise(got, rope_interleaved_triton(rms_norm_triton(x, w, eps), pos, inv), f"{what}: vs the two kernels")
    assert_rel_close(got, rms_norm_rope_ref(x, w, eps, pos, inv), TOL[x.dtype], f"{what}: vs the reference")
    table, rows = _table_case(x, 2 * x.shape[0] + 3, x.shape[0])
    want = _expect_rows(table, got, rows)
    rows = torch.stack([rows, -rows], dim=1)[:, 0]  # a strided column of a row table, as a decode step passes
    assert rms_norm_rope_triton(x, w, eps, pos, inv, out=table, out_rows=rows) is table
    assert_bitwise(table, want, f"{what}: out / out_rows")


def _interp_cases() -> None:
    from deepinfer_kernels.ops.rms_norm_rope.triton import rms_norm_rope_triton

    for dtype in (torch.float32, torch.bfloat16):
        for shape, rope_dim, weighted in (((3, 2, 32), 16, False), ((5, 48), 16, True), ((2, 3, 64), 64, True)):
            x, w, pos, inv = _inputs(shape, rope_dim, weighted, dtype, "cpu", sum(shape))
            _check(x, w, pos, inv, 1e-6, f"{dtype} {shape} R={rope_dim} weighted={weighted}")
    x, w, pos, inv = _inputs((4, 32), 16, True, torch.float32, "cpu", 9)
    x[1] = 0  # V4.1's eps: an all-zero row stays zero
    assert not rms_norm_rope_triton(x, w, 1e-20, pos, inv)[1].any()


if triton_importable():  # one TRITON_INTERPRET=1 child process
    test_interpreter = interpreted_cases_test(__file__, {"cases": ("_interp_cases", ())})


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256, 4096])
@pytest.mark.parametrize(
    ("tail", "rope_dim", "weighted"),
    [((64, 512), 64, False), ((512,), 64, True), ((128,), 64, True), ((1024,), 64, True)],
    ids=["v4-query-heads", "kv-and-entries", "v41-index-key", "wide"],
)
def test_gpu_bitwise_vs_the_two_kernels(t, tail, rope_dim, weighted):
    x, w, pos, inv = _inputs((t, *tail), rope_dim, weighted, torch.bfloat16, "cuda", t + len(tail))
    _check(x, w, pos, inv, 1e-6, f"{(t, *tail)}")
    _check(x.float(), w, pos, inv, 1e-20, f"fp32 {(t, *tail)}")


@pytest.mark.gpu
def test_gpu_registry():
    from deepinfer_kernels.ops.rms_norm_rope.triton import rms_norm_rope_triton

    assert resolve("rms_norm_rope", "cuda") is rms_norm_rope_triton

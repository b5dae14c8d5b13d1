"""Triton kv_compress_pool / kv_compress_pool_rows vs the reference: under Triton's interpreter on CPU at small
shapes (one child process) and on CUDA at the models' shapes (HCA L=128 C=512, CSA L=8 C=512 / 128 from
1024- / 256-wide rows, V4.1 ratio 2), fresh random inputs. Pooling gathered ring rows equals pooling the same
groups laid out densely, bitwise (what makes a planned decode step equal the per-request path), and a group's
bits do not depend on the other groups of the call."""

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_kernels.ops.kv_compress.reference import kv_compress_pool_ref, kv_compress_pool_rows_ref  # noqa: E402
from deepinfer_kernels.ops.kv_compress.triton import (  # noqa: E402
    kv_compress_pool_rows_triton,
    kv_compress_pool_triton,
)
from deepinfer_kernels.testing.compare import assert_bitwise, assert_rel_close  # noqa: E402
from deepinfer_kernels.testing.triton_interpreter import interpreted_cases_test  # noqa: E402


def _rings(groups: int, slots: int, ck: int, device, seed: int):
    """Row tables [N, Ck] (N > needed, rows scattered) and each group's row ids [B, L], some empty (-1)."""
    g = torch.Generator().manual_seed(seed)
    n = groups * slots * 2 + 3
    kv = torch.randn(n, ck, generator=g)
    score = torch.randn(n, ck, generator=g) * 3
    rows = torch.randperm(n, generator=g)[: groups * slots].view(groups, slots)
    rows[0, : slots // 2] = -1  # a group with empty leading slots (CSA's first window)
    return kv.to(device), score.to(device), rows.to(device)


def _dense(kv, score, rows, lead, width):
    """The same groups as a dense [B, L, C] layout: empty slots kv 0, score -inf (the general path's)."""
    ck, held = kv.shape[1], (rows >= 0)[..., None]
    gk, gs = kv[rows.clamp(min=0)], score[rows.clamp(min=0)]
    gk = torch.cat([gk[:, :lead, :width], gk[:, lead:, ck - width :]], dim=1)
    gs = torch.cat([gs[:, :lead, :width], gs[:, lead:, ck - width :]], dim=1)
    return torch.where(held, gk, 0.0), torch.where(held, gs, float("-inf"))


def _check(groups, slots, ck, width, lead, device, seed):
    kv, score, rows = _rings(groups, slots, ck, device, seed)
    got = kv_compress_pool_rows_triton(kv, score, rows, lead, width)
    assert_rel_close(got, kv_compress_pool_rows_ref(kv, score, rows, lead, width), 2e-6, f"rows L={slots}")
    dk, ds = _dense(kv, score, rows, lead, width)
    dense = kv_compress_pool_triton(dk, ds)
    assert_rel_close(dense, kv_compress_pool_ref(dk, ds), 2e-6, f"dense L={slots}")
    assert_bitwise(got, dense, f"ring rows vs dense layout L={slots} C={width}")
    for b in (0, groups - 1):  # one group alone: the same bits
        assert_bitwise(kv_compress_pool_rows_triton(kv, score, rows[b : b + 1], lead, width)[0], got[b], f"group {b}")
    half = kv_compress_pool_rows_triton(kv, score, rows, lead, width, out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    if kv.is_cuda:  # one rounding at the store, to nearest even: torch's cast of the fp32 result
        assert_bitwise(half, got.to(torch.bfloat16), f"out_dtype bf16 L={slots}")
    else:  # the interpreter's bf16 store truncates
        assert_rel_close(half.float(), got, 8e-3, f"out_dtype bf16 L={slots}")


def _interp_case(groups, slots, ck, width, lead):
    _check(groups, slots, ck, width, lead, "cpu", slots * 7 + ck)


def _interp_empty_slot_weight_and_shapes():
    kv = torch.tensor([[1.0], [5.0], [2.0]])
    score = torch.tensor([[0.0], [9.0], [0.0]])
    rows = torch.tensor([[0, -1, 2]])  # row 1 (large score) is not in the group
    assert torch.equal(kv_compress_pool_rows_triton(kv, score, rows, 0, 1), torch.tensor([[1.5]]))
    x = torch.randn(2, 3, 4, 8, 16)  # leading dims kept
    assert kv_compress_pool_triton(x, x).shape == (2, 3, 4, 16)
    assert kv_compress_pool_triton(x[:0], x[:0]).shape == (0, 3, 4, 16)


INTERP_CASES = {
    "hca-like": ("_interp_case", (3, 16, 64, 64, 0)),
    "csa-overlap": ("_interp_case", (4, 8, 96, 48, 4)),
    "ratio2": ("_interp_case", (5, 2, 40, 40, 0)),
    "one-slot-wide": ("_interp_case", (2, 1, 600, 600, 0)),  # C > BC: several channel blocks
    "empty-slot-weight-and-shapes": ("_interp_empty_slot_weight_and_shapes", ()),
}

test_interpreter = interpreted_cases_test(__file__, INTERP_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "slots,ck,width,lead",
    [(128, 512, 512, 0), (8, 1024, 512, 4), (8, 256, 128, 4), (2, 512, 512, 0)],
    ids=["hca", "csa", "csa-indexer", "v41-ratio2"],
)
def test_gpu_models_shapes(slots, ck, width, lead):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for groups in (1, 257):
        _check(groups, slots, ck, width, lead, "cuda", groups + slots)


def test_out_dtype_through_the_op():
    """The op's out_dtype: the pooled fp32 values rounded once (the reference: its fp32 result cast); a non-float
    dtype is refused by name."""
    from deepinfer_kernels.ops.kv_compress import kv_compress_pool_rows

    kv, score, rows = _rings(3, 8, 96, "cpu", 5)
    got = kv_compress_pool_rows(kv, score, rows, 4, 48, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kv_compress_pool_rows_ref(kv, score, rows, 4, 48).to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        kv_compress_pool_rows(kv, score, rows, 4, 48, out_dtype=torch.int32)

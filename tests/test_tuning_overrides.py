"""benchmarks/tuning_overrides.py: ``--set MODULE.NAME=VALUE`` changes a module global for the run, and a spec that
would change nothing (unknown module or name, no literal, no '=') is an error naming it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from tuning_overrides import apply_overrides  # noqa: E402

pytest.importorskip("triton")


def test_sets_a_module_global_read_at_call_time(monkeypatch):
    from deepinfer_kernels.ops.linear_many import triton as many

    monkeypatch.setattr(many, "DECODE_STAGES", many.DECODE_STAGES)  # restored after the test
    done = apply_overrides(["deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES=4"])
    assert done == {"deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES": 4}
    assert many.decode_tiling(4096).stages == 4
    monkeypatch.setattr(many, "DECODE_K_SPLIT", many.DECODE_K_SPLIT)
    apply_overrides(["deepinfer_kernels.ops.linear_many.triton.DECODE_K_SPLIT = 512"])
    assert many.decode_tiling(4096).k_split == 512


def test_sets_a_key_of_a_module_dict_in_place(monkeypatch):
    import torch
    from deepinfer_kernels.ops.grouped_gemm import triton as grouped

    monkeypatch.setitem(grouped.GATHER_BF16, "BLOCK_N", grouped.GATHER_BF16["BLOCK_N"])  # restored after the test
    done = apply_overrides(["deepinfer_kernels.ops.grouped_gemm.triton.GATHER_BF16.BLOCK_N=64"])
    assert done == {"deepinfer_kernels.ops.grouped_gemm.triton.GATHER_BF16.BLOCK_N": 64}
    assert grouped.GATHER_CFG[torch.bfloat16]["BLOCK_N"] == 64  # the dict the kernel's launcher reads
    with pytest.raises(ValueError, match="has no key 'BLOCK_X'"):
        apply_overrides(["deepinfer_kernels.ops.grouped_gemm.triton.GATHER_BF16.BLOCK_X=64"])
    with pytest.raises(ValueError, match="cannot import"):  # not a dict: no key to set
        apply_overrides(["deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES.X=1"])


@pytest.mark.parametrize(
    "spec, says",
    [
        ("deepinfer_kernels.ops.linear_many.triton.DECODE_STAGE=4", "has no 'DECODE_STAGE'"),
        ("deepinfer_kernels.ops.no_such_op.X=1", "cannot import"),
        ("deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES=four", "not a Python literal"),
        ("DECODE_STAGES=4", "expected MODULE.NAME=VALUE"),
        ("deepinfer_kernels.ops.linear_many.triton.DECODE_STAGES", "expected MODULE.NAME=VALUE"),
    ],
)
def test_bad_specs_name_the_problem(spec, says):
    with pytest.raises(ValueError, match=says):
        apply_overrides([spec])

"""The optional DeepEP path: backend selection, and ``deep_ep_moe`` through a fake of DeepEP's ``Buffer`` API over
gloo (real deep_ep is not installable here: this exercises the adapter's plumbing, not DeepEP)."""

import sys
import types

import parallel_workers as W
import pytest
import torch
from deepinfer_parallel.deep_ep_adapter import select_ep_backend

CASES = {2: [37, 21], 4: [19, 0, 33, 8]}


@pytest.mark.parametrize("world", [2, 4])
def test_deep_ep_moe_through_fake_buffer_matches_single_process(world, ranks):
    outs = ranks(world, W.deep_ep_vs_reference, 7, 16, 4, 4, 24, CASES[world])
    for rank, (out, ref, calls) in enumerate(outs):
        assert out.shape == (CASES[world][rank], 24) and out.dtype == torch.bfloat16
        # one bf16 rounding of the per-rank partial sums before the combine: close, not bitwise
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        assert calls == {"get_dispatch_layout": 1, "dispatch": 1, "combine": 1}


def test_backend_selection_falls_back_with_a_reason(monkeypatch):
    logged = []
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises
    assert select_ep_backend("deep_ep", "cuda", "nccl", logged.append) == "all_to_all"
    assert "`import deep_ep` fails" in logged[-1] and "using all_to_all" in logged[-1]
    assert select_ep_backend("deep_ep", "cpu", "gloo", logged.append) == "all_to_all"
    assert "needs CUDA ranks with NCCL (here: cpu, gloo)" in logged[-1]
    v2 = types.ModuleType("deep_ep")
    v2.__version__, v2.EPBuffer = "2.5.0", object  # DeepEP V2: EPBuffer, no Buffer
    monkeypatch.setitem(sys.modules, "deep_ep", v2)
    assert select_ep_backend("deep_ep", "cuda", "nccl", logged.append) == "all_to_all"
    assert "deep_ep 2.5.0 has no V1 `Buffer`" in logged[-1]
    v1 = types.ModuleType("deep_ep")
    v1.Buffer = object
    monkeypatch.setitem(sys.modules, "deep_ep", v1)
    n = len(logged)
    assert select_ep_backend("deep_ep", "cuda", "nccl", logged.append) == "deep_ep"
    assert select_ep_backend("all_to_all", "cuda", "nccl", logged.append) == "all_to_all"
    assert len(logged) == n  # no fallback, no log line
    with pytest.raises(ValueError, match="EP backend must be one of"):
        select_ep_backend("nvshmem", "cuda", "nccl")

"""The compute-capability probes the GPU backends register with (``_triton_launch.sm90_or_newer`` / ``hopper``):
FP8, PDL and bulk prefetch need sm_90 or newer; the wgmma kernels (the sparse attention's wide Gluon kernel, the
MXFP4 experts of 9-32 rows) need Hopper itself, so a Blackwell device (10.x) must not select them. The CUDA
queries are stubbed: only the logic is under test."""

import pytest
import torch
from deepinfer_kernels.ops import _triton_launch
from deepinfer_kernels.ops._triton_launch import hopper, sm90_or_newer


@pytest.fixture
def fake_gpu(monkeypatch):
    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(_triton_launch, "_capability", lambda index: capability)

    return install


@pytest.mark.parametrize(
    "capability,newer,is_hopper", [((8, 9), False, False), ((9, 0), True, True), ((10, 0), True, False)]
)
def test_capability_predicates(fake_gpu, capability, newer, is_hopper):
    fake_gpu(capability)
    for device in (None, 0, torch.device("cuda"), torch.device("cuda", 0)):
        assert sm90_or_newer(device) is newer
        assert hopper(device) is is_hopper
    assert not sm90_or_newer(torch.device("cpu")) and not hopper(torch.device("cpu"))


def test_no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not sm90_or_newer() and not hopper() and not hopper(torch.device("cuda", 0))

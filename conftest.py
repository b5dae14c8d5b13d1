"""Repository-wide pytest hooks: GPU / NPU tests skip cleanly where the hardware is absent, and
benchmarks run only when asked for (``-m bench``)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_npu = hasattr(torch, "npu") and torch.npu.is_available()
    want_bench = "bench" in (config.getoption("-m") or "")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU"))
        if "bench" in item.keywords and not want_bench:
            item.add_marker(pytest.mark.skip(reason="benchmark: run with -m bench"))

"""deepinfer-ascend: the Huawei Ascend (torch_npu) backend, found by deepinfer-kernels through the
``deepinfer_kernels.backends`` entry point.

``register()`` adds NPU implementations to the op registry when ``torch_npu`` imports; without it
(every machine but an Ascend host) it registers nothing and the references serve NPU-less runs.
No NPU op implementations exist yet: this package currently provides the plugin hook only.
"""

from __future__ import annotations

import importlib.util

__version__ = "0.1.0"


def npu_available() -> bool:
    """True when torch_npu is importable (it needs CANN; never installed in CI)."""
    return importlib.util.find_spec("torch_npu") is not None


def register() -> list[str]:
    """Register the NPU backends; returns the op names registered (empty without torch_npu)."""
    if not npu_available():
        return []
    return []

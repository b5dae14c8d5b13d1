"""The plugin is discoverable through its entry point and harmless without torch_npu."""

from importlib.metadata import entry_points

import deepinfer_ascend


def test_entry_point_is_declared_and_register_is_harmless():
    eps = {ep.name: ep for ep in entry_points(group="deepinfer_kernels.backends")}
    assert "ascend" in eps and eps["ascend"].load() is deepinfer_ascend.register
    assert deepinfer_ascend.register() == [] or deepinfer_ascend.npu_available()

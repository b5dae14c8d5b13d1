"""The op registry: reference fallback, priorities, device filtering, pins and the force switch."""

import pytest
import torch
from deepinfer_kernels import registry
from deepinfer_kernels.registry import dispatch, register_backend, register_reference, resolve


@pytest.fixture
def toy_op(monkeypatch):
    monkeypatch.setattr(registry, "_OPS", dict(registry._OPS))
    monkeypatch.setattr(registry, "_CHOSEN", {})
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE", raising=False)
    register_reference("toy_op")(lambda x: ("reference", x))
    return "toy_op"


def test_reference_is_the_fallback(toy_op):
    assert dispatch(toy_op, "cpu", 1) == ("reference", 1)


def test_highest_available_backend_for_the_device_wins(toy_op):
    register_backend(toy_op, "slow", lambda x: ("slow", x), devices=("cpu",), priority=1)
    register_backend(toy_op, "fast", lambda x: ("fast", x), devices=("cpu",), priority=5)
    register_backend(toy_op, "broken", lambda x: ("broken", x), devices=("cpu",), priority=9, available=lambda: False)
    register_backend(toy_op, "gpu", lambda x: ("gpu", x), devices=("cuda",), priority=99)
    assert dispatch(toy_op, "cpu", 0)[0] == "fast"
    assert resolve(toy_op, torch.device("cuda"))(0)[0] == "gpu"


def test_force_reference_and_pin(toy_op, monkeypatch):
    register_backend(toy_op, "fast", lambda x: ("fast", x), devices=("cpu",), priority=5)
    assert dispatch(toy_op, "cpu", 0)[0] == "fast"
    monkeypatch.setenv("DEEPINFER_FORCE_REFERENCE", "1")
    assert dispatch(toy_op, "cpu", 0)[0] == "reference"
    monkeypatch.delenv("DEEPINFER_FORCE_REFERENCE")
    registry._CHOSEN.clear()
    monkeypatch.setenv("DEEPINFER_BACKEND_TOY_OP", "reference")
    assert dispatch(toy_op, "cpu", 0)[0] == "reference"
    registry._CHOSEN.clear()
    monkeypatch.setenv("DEEPINFER_BACKEND_TOY_OP", "nope")
    with pytest.raises(ValueError, match="no such backend"):
        dispatch(toy_op, "cpu", 0)


def test_errors_name_the_problem(toy_op):
    with pytest.raises(KeyError, match="unknown op"):
        resolve("no_such_op")
    with pytest.raises(KeyError, match="unknown op"):
        register_backend("no_such_op", "x", lambda: None, devices=("cpu",))
    with pytest.raises(ValueError, match="already has a reference"):
        register_reference(toy_op)(lambda x: x)


def test_every_public_op_has_a_reference():
    import deepinfer_kernels

    ops = registry.list_ops()
    for name in ("rms_norm", "rope_interleaved", "sparse_mqa_attention", "kv_compress_pool", "grouped_linear"):
        assert ops[name][0] == "reference"
    assert callable(deepinfer_kernels.rms_norm)


def test_batch_invariant_mode_admits_only_invariant_backends(toy_op, monkeypatch):
    register_backend(toy_op, "fast", lambda x: ("fast", x), devices=("cpu",), priority=9)
    register_backend(toy_op, "steady", lambda x: ("steady", x), devices=("cpu",), priority=1, batch_invariant=True)
    monkeypatch.setattr(registry, "_BATCH_INVARIANT", None)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    assert dispatch(toy_op, "cpu", 0)[0] == "fast"
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert registry.batch_invariant() and dispatch(toy_op, "cpu", 0)[0] == "steady"
    registry.set_batch_invariant(False)  # the explicit switch wins over the environment
    assert dispatch(toy_op, "cpu", 0)[0] == "fast"
    registry.set_batch_invariant(True)
    registry._CHOSEN.clear()  # resolution is cached per process; a new pin needs a fresh resolution
    monkeypatch.setenv("DEEPINFER_BACKEND_TOY_OP", "fast")
    with pytest.raises(ValueError, match="not batch-invariant"):
        dispatch(toy_op, "cpu", 0)
    registry.set_batch_invariant(None)

"""Op registry: one reference and any number of backends per op, chosen once per process.

Every public op in ``deepinfer_kernels.ops`` is registered here under one name (the op's folder
name). Its plain-PyTorch reference is always available and defines what "correct" means;
backends (Triton, TileLang, adapters to flash_mla / deep_gemm, the Ascend plugin) register
later with a priority and the device types they serve.

Selection happens once per (op, device type) and is cached:

* ``DEEPINFER_FORCE_REFERENCE=1`` routes every op to its reference (bisecting numerical bugs);
* batch-invariant mode (``DEEPINFER_BATCH_INVARIANT=1`` or ``set_batch_invariant(True)``) only admits
  backends registered with ``batch_invariant=True``: a row's result may not depend on the other rows.
  Every reference is row-invariant by construction, so the references always qualify;
* ``DEEPINFER_BACKEND_<OP>=<backend>`` pins one op to one backend (upper-case op name);
* otherwise the available backend with the highest priority wins, the reference last.

Plugins (``deepinfer-ascend``) are found through the ``deepinfer_kernels.backends`` entry point
group the first time an op is resolved; a plugin that fails to import is skipped with a warning.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import torch

REFERENCE = "reference"


@dataclass
class Backend:
    """One implementation of an op.

    ``devices`` are torch device types ("cpu", "cuda", "npu"); ``available`` is probed once
    (imports, compute capability) the first time the op is resolved for a device type.
    """

    name: str
    fn: Callable
    devices: tuple[str, ...]
    priority: int = 0
    available: Callable[[], bool] = lambda: True
    batch_invariant: bool = False


@dataclass
class OpEntry:
    name: str
    reference: Callable
    backends: dict[str, Backend] = field(default_factory=dict)


_OPS: dict[str, OpEntry] = {}
_CHOSEN: dict[tuple[str, str, bool], Callable] = {}
_PLUGINS_LOADED = False
_BATCH_INVARIANT: bool | None = None  # None: follow DEEPINFER_BATCH_INVARIANT


def _truthy(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def batch_invariant() -> bool:
    """True in batch-invariant mode (``set_batch_invariant`` wins over ``DEEPINFER_BATCH_INVARIANT``)."""
    return _truthy("DEEPINFER_BATCH_INVARIANT") if _BATCH_INVARIANT is None else _BATCH_INVARIANT


def set_batch_invariant(on: bool | None) -> None:
    """Turn batch-invariant mode on or off for this process (None: back to the environment variable)."""
    global _BATCH_INVARIANT
    _BATCH_INVARIANT = on


def force_reference() -> bool:
    """True when ``DEEPINFER_FORCE_REFERENCE`` is set to a true value."""
    return _truthy("DEEPINFER_FORCE_REFERENCE")


def register_reference(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the reference of op ``name`` (exactly one per op)."""

    def deco(fn: Callable) -> Callable:
        if name in _OPS:
            raise ValueError(f"op {name!r} already has a reference ({_OPS[name].reference.__module__})")
        _OPS[name] = OpEntry(name, fn)
        return fn

    return deco


def register_backend(
    op: str,
    backend: str,
    fn: Callable,
    *,
    devices: tuple[str, ...],
    priority: int = 10,
    available: Callable[[], bool] = lambda: True,
    batch_invariant: bool = False,
) -> None:
    """Add a backend for ``op``; re-registering the same backend name replaces it. ``batch_invariant``
    declares that each output row is independent of the other rows (bitwise), which the backend's tests
    must check; only such backends serve batch-invariant mode."""
    if op not in _OPS:
        raise KeyError(f"unknown op {op!r}: import its reference before registering backends")
    if backend == REFERENCE:
        raise ValueError("the name 'reference' is reserved")
    _OPS[op].backends[backend] = Backend(backend, fn, tuple(devices), priority, available, batch_invariant)
    _CHOSEN.clear()


def _load_plugins() -> None:
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for ep in entry_points(group="deepinfer_kernels.backends"):
        try:
            ep.load()()
        except Exception as exc:  # a broken optional plugin must not take the engine down
            warnings.warn(f"deepinfer backend plugin {ep.name!r} failed to load: {exc}", stacklevel=2)


def resolve(op: str, device: torch.device | str = "cpu") -> Callable:
    """The implementation of ``op`` used for tensors on ``device`` (cached per process)."""
    device_type = torch.device(device).type
    invariant = batch_invariant()
    key = (op, device_type, invariant)
    fn = _CHOSEN.get(key)
    if fn is not None and not force_reference():
        return fn
    if op not in _OPS:
        raise KeyError(f"unknown op {op!r}; known: {sorted(_OPS)}")
    entry = _OPS[op]
    if force_reference():
        return entry.reference
    _load_plugins()
    pinned = os.environ.get(f"DEEPINFER_BACKEND_{op.upper()}")
    if pinned == REFERENCE:
        fn = entry.reference
    elif pinned:
        if pinned not in entry.backends:
            raise ValueError(
                f"DEEPINFER_BACKEND_{op.upper()}={pinned!r}: no such backend for {op!r} "
                f"(have: {[REFERENCE, *entry.backends]})"
            )
        if invariant and not entry.backends[pinned].batch_invariant:
            raise ValueError(
                f"DEEPINFER_BACKEND_{op.upper()}={pinned!r} is not batch-invariant (batch-invariant mode is on)"
            )
        fn = entry.backends[pinned].fn
    else:
        fn = entry.reference
        candidates = sorted(entry.backends.values(), key=lambda b: -b.priority)
        for b in candidates:
            if device_type in b.devices and (b.batch_invariant or not invariant) and b.available():
                fn = b.fn
                break
    _CHOSEN[key] = fn
    return fn


def dispatch(op: str, device: torch.device | str, *args, **kwargs):
    """Call the chosen implementation of ``op`` for ``device``."""
    return resolve(op, device)(*args, **kwargs)


def reference(op: str) -> Callable:
    """The reference implementation of ``op`` (always available)."""
    return _OPS[op].reference


def list_ops() -> dict[str, list[str]]:
    """Op name -> backend names (reference first)."""
    return {name: [REFERENCE, *e.backends] for name, e in sorted(_OPS.items())}

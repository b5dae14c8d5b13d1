"""Op registry: one reference and any number of backends per op, chosen once per process.

Every public op in ``deepinfer_kernels.ops`` is registered here under one name (the op's folder
name). Its plain-PyTorch reference is always available and defines what "correct" means;
backends (Triton, TileLang, adapters to flash_mla / deep_gemm, the Ascend plugin) register
later with a priority and the device types they serve.

Selection happens once per (op, device type) and is cached:

* ``DEEPINFER_FORCE_REFERENCE=1`` routes every op to its reference (bisecting numerical bugs);
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


@dataclass
class OpEntry:
    name: str
    reference: Callable
    backends: dict[str, Backend] = field(default_factory=dict)


_OPS: dict[str, OpEntry] = {}
_CHOSEN: dict[tuple[str, str], Callable] = {}
_PLUGINS_LOADED = False


def force_reference() -> bool:
    """True when ``DEEPINFER_FORCE_REFERENCE`` is set to a true value."""
    return os.environ.get("DEEPINFER_FORCE_REFERENCE", "0").lower() in ("1", "true", "yes", "on")


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
) -> None:
    """Add a backend for ``op``; re-registering the same backend name replaces it."""
    if op not in _OPS:
        raise KeyError(f"unknown op {op!r}: import its reference before registering backends")
    if backend == REFERENCE:
        raise ValueError("the name 'reference' is reserved")
    _OPS[op].backends[backend] = Backend(backend, fn, tuple(devices), priority, available)
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
    key = (op, device_type)
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
        fn = entry.backends[pinned].fn
    else:
        fn = entry.reference
        candidates = sorted(entry.backends.values(), key=lambda b: -b.priority)
        for b in candidates:
            if device_type in b.devices and b.available():
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

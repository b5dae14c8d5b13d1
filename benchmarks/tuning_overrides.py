"""``--set MODULE.NAME=VALUE`` for the model benchmarks: a kernel's tuning constant changed for one run, so that an
A/B of two settings runs from one tree in one lease (the old way was a copy of the tree per setting, each compiling
every kernel anew).

Only module globals that the code reads when it is called take effect (``linear_many.triton.DECODE_STAGES``,
``moe.route_triton.ROUTE_WARPS``, ``topk_select.triton.SPLIT_CHUNK``...); a name another module imported by value
keeps the old value there; ``MODULE.NAME.KEY=VALUE`` sets a key of a module dict in place (a tiling dict read per
call). VALUE is a Python literal (``4``, ``1024``, ``(64, 128)``, ``'x'``).
"""

from __future__ import annotations

import ast
import importlib


def apply_overrides(specs: list[str]) -> dict[str, object]:
    """Set each ``MODULE.NAME=VALUE`` of ``specs`` (or ``MODULE.NAME.KEY=VALUE``: the existing str key KEY of the
    module dict NAME, set in place, e.g. ``deepinfer_kernels.ops.grouped_gemm.triton.GATHER_BF16.BLOCK_N=64``);
    returns {spec target: value} for the run's record. Raises ValueError naming the spec when it is malformed, its
    module does not import, the module has no such name or the dict no such key (a typo would otherwise change
    nothing, silently) or the value is no literal."""
    done: dict[str, object] = {}
    for spec in specs:
        target, sep, text = spec.partition("=")
        target = target.strip()
        module_name, dot, name = target.rpartition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--set {spec!r}: expected MODULE.NAME=VALUE")
        key = None
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            parent, dot, dict_name = module_name.rpartition(".")
            try:  # MODULE.NAME.KEY: one level up is the module
                module = importlib.import_module(parent) if dot else None
            except ImportError:
                module = None
            if module is None or not isinstance(getattr(module, dict_name, None), dict):
                raise ValueError(f"--set {spec!r}: cannot import {module_name!r} ({exc})") from None
            key, name, module_name = name, dict_name, parent
        if not hasattr(module, name):
            raise ValueError(f"--set {spec!r}: module {module_name!r} has no {name!r}")
        if key is not None and key not in getattr(module, name):
            raise ValueError(f"--set {spec!r}: {module_name}.{name} has no key {key!r}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {spec!r}: {text!r} is not a Python literal") from None
        if key is None:
            setattr(module, name, value)
        else:
            getattr(module, name)[key] = value
        done[target] = value
    return done

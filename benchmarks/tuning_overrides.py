"""``--set MODULE.NAME=VALUE`` for the model benchmarks: a kernel's tuning constant changed for one run, so that an
A/B of two settings runs from one tree in one lease (the old way was a copy of the tree per setting, each compiling
every kernel anew).

Only module globals that the code reads when it is called take effect (``linear_many.triton.DECODE_STAGES``,
``moe.route_triton.ROUTE_WARPS``, ``topk_select.triton.SPLIT_CHUNK``...); a name another module imported by value
keeps the old value there. VALUE is a Python literal (``4``, ``1024``, ``(64, 128)``, ``'x'``).
"""

from __future__ import annotations

import ast
import importlib


def apply_overrides(specs: list[str]) -> dict[str, object]:
    """Set each ``MODULE.NAME=VALUE`` of ``specs``; returns {``MODULE.NAME``: value} for the run's record. Raises
    ValueError naming the spec when it is malformed, its module does not import, the module has no such name (a
    typo would otherwise change nothing, silently) or the value is no literal."""
    done: dict[str, object] = {}
    for spec in specs:
        target, sep, text = spec.partition("=")
        module_name, dot, name = target.strip().rpartition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--set {spec!r}: expected MODULE.NAME=VALUE")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"--set {spec!r}: cannot import {module_name!r} ({exc})") from None
        if not hasattr(module, name):
            raise ValueError(f"--set {spec!r}: module {module_name!r} has no {name!r}")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {spec!r}: {text!r} is not a Python literal") from None
        setattr(module, name, value)
        done[f"{module_name}.{name}"] = value
    return done

"""Helpers shared by the config parsers: typed field reads and reading config.json with clear errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from deepinfer_runtime.errors import ConfigError

T = TypeVar("T")


def take_field(raw: dict, key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    """Pop ``key`` from ``raw`` checking its type (ints accepted for floats, bools never for ints)."""
    if key not in raw:
        if default is ...:
            raise ConfigError(f"missing required field {key!r}")
        return default
    value = raw.pop(key)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"field {key!r} = {value!r} should be of type {getattr(typ, '__name__', typ)}")
    return value


def parse_config_file(path: str | Path, parse: Callable[[dict[str, Any]], T]) -> T:
    """Read ``path`` as JSON and ``parse`` it; every ConfigError is prefixed with the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    try:
        return parse(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None

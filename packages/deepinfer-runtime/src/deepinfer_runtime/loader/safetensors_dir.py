"""A directory of safetensors shards, opened lazily and validated up front.

Accepts ``model.safetensors.index.json`` (HF sharded layout) or, without an index, every
``*.safetensors`` file in the directory. Every problem is reported as one ``CheckpointError``
naming the directory and the missing shard, the corrupt file or the duplicated tensor.

Reads are counted (``bytes_read``, ``read_log``): a rank that loads only its share of the checkpoint
(``loader/shard.py``) reports what it really materialised, and tests assert it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer_runtime.errors import CheckpointError


class SafetensorsDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"model directory {str(self.path)!r} does not exist")
        index = self.path / "model.safetensors.index.json"
        self.shard_of: dict[str, str] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise CheckpointError(f"{self.path}: shard file(s) named in the index are missing: {missing}")
            self.shard_of = dict(weight_map)
            listed: dict[str, set[str]] = {}
            for name, f in weight_map.items():
                listed.setdefault(f, set()).add(name)
            for f, names in listed.items():
                have = self._keys(f)
                absent = sorted(names - have)
                if absent:
                    raise CheckpointError(
                        f"{self.path / f}: {len(absent)} tensor(s) listed in the index are not "
                        f"in the shard, e.g. {absent[:5]}"
                    )
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no model.safetensors.index.json")
            for f in files:
                for name in self._keys(f):
                    if name in self.shard_of:
                        raise CheckpointError(f"{self.path}: tensor {name!r} is in both {self.shard_of[name]} and {f}")
                    self.shard_of[name] = f
        self._handles: dict[str, object] = {}
        self.read_log: dict[str, int] = {}  # tensor name -> bytes read (a row slice counts its rows only)

    @property
    def bytes_read(self) -> int:
        return sum(self.read_log.values())

    def file_bytes(self) -> int:
        """Total size of the shard files (headers included)."""
        return sum((self.path / f).stat().st_size for f in set(self.shard_of.values()))

    def _keys(self, file: str) -> set[str]:
        try:
            with safe_open(self.path / file, framework="pt") as fh:
                return set(fh.keys())
        except Exception as exc:  # safetensors raises several types for a bad header
            raise CheckpointError(f"{self.path / file}: cannot read safetensors header ({exc})") from None

    def names(self) -> set[str]:
        return set(self.shard_of)

    def _handle(self, name: str):
        file = self.shard_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(self.path / file, framework="pt")
        return handle

    def _corrupt(self, name: str, exc: Exception) -> CheckpointError:
        return CheckpointError(f"{self.path / self.shard_of[name]}: tensor {name!r} is corrupt ({exc})")

    def get(self, name: str) -> torch.Tensor:
        try:
            tensor = self._handle(name).get_tensor(name)
        except Exception as exc:
            raise self._corrupt(name, exc) from None
        self.read_log[name] = self.read_log.get(name, 0) + tensor.nbytes
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, from the header (reads no data)."""
        try:
            return tuple(self._handle(name).get_slice(name).get_shape())
        except Exception as exc:
            raise self._corrupt(name, exc) from None

    def get_rows(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Rows [lo, hi) of ``name`` along dim 0 (reads only those bytes); ``rows=None``: the whole tensor."""
        if rows is None:
            return self.get(name)
        lo, hi = rows
        try:
            tensor = self._handle(name).get_slice(name)[lo:hi]
        except Exception as exc:
            raise self._corrupt(name, exc) from None
        self.read_log[name] = self.read_log.get(name, 0) + tensor.nbytes
        return tensor

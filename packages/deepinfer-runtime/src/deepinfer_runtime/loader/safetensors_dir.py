"""A directory of safetensors shards, opened lazily and validated up front.

Accepts ``model.safetensors.index.json`` (HF sharded layout) or, without an index, every
``*.safetensors`` file in the directory. Every problem is reported as one ``CheckpointError``
naming the directory and the missing shard, the corrupt file or the duplicated tensor.
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

    def _keys(self, file: str) -> set[str]:
        try:
            with safe_open(self.path / file, framework="pt") as fh:
                return set(fh.keys())
        except Exception as exc:  # safetensors raises several types for a bad header
            raise CheckpointError(f"{self.path / file}: cannot read safetensors header ({exc})") from None

    def names(self) -> set[str]:
        return set(self.shard_of)

    def get(self, name: str) -> torch.Tensor:
        file = self.shard_of[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(self.path / file, framework="pt")
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{self.path / file}: tensor {name!r} is corrupt ({exc})") from None

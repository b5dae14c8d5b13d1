"""Cache kinds and their byte sizes: what a model reports so the engine can budget memory exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheKind:
    """One cache kind: ``bytes_per_token`` of growth (0 for fixed kinds) and ``fixed_bytes`` per request."""

    name: str
    bytes_per_token: float
    fixed_bytes: int


@dataclass(frozen=True)
class CacheLayout:
    kinds: tuple[CacheKind, ...]

    @property
    def bytes_per_token(self) -> float:
        return sum(k.bytes_per_token for k in self.kinds)

    @property
    def fixed_bytes(self) -> int:
        return sum(k.fixed_bytes for k in self.kinds)

    def table(self) -> str:
        rows = [f"{'cache kind':<28}{'bytes/token':>14}{'bytes/request':>16}"]
        rows += [f"{k.name:<28}{k.bytes_per_token:>14,.1f}{k.fixed_bytes:>16,}" for k in self.kinds]
        rows.append(f"{'total':<28}{self.bytes_per_token:>14,.1f}{self.fixed_bytes:>16,}")
        return "\n".join(rows)

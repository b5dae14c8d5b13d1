"""Prefix caching: chained block hashes, shared pool blocks and snapshots of the fixed-size state.

A full block of ``block_size`` tokens is keyed by hash(previous block's key, its tokens), so a key
names the whole prefix up to the block's end. When a request has computed a full block, the block is
registered under its key; its pool rows (compressed KV, index keys) are then immutable and any later
request with the same prefix shares the block instead of recomputing it.

Growing state alone does not resume a sequence: the window tails, compressor tails, Engram lookback and
DSpark context at the boundary are needed too. Those are kept as a ``CacheSnapshot`` per key, taken
whenever a request's computed tokens end exactly on a block boundary (the scheduler cuts prefill chunks
there). A hit is the longest cached chain whose last block has a snapshot, capped at ``limit`` tokens.

The cap is the bounded replay: the engine recomputes at least ``replay`` final tokens. For V4 and V4.1
without YOCO truncation that is 1 (the row that yields the first logits). For V4.1 with truncation it is
the keep length K (decisions Y5: rewind the recompute start by K tokens): the decoder layers then see
only windows rebuilt from this request's last K tokens, exactly as without a hit, and the snapshot's
decoder windows are never visible. Only encoder-side state (encoder windows, compressed KV, index keys,
compressor tails) is taken from the cache, and it is a function of the tokens alone. So a hit gives the
same values as computing the prefix, bit for bit when the kernels are batch invariant.

Snapshots are bounded (LRU, ``max_snapshots``): each holds one snapshot slot of the engine's ``SlotPool`` (the
budget reserves them), given back when the snapshot is dropped; a snapshot whose chain lost a block is
unreachable and dropped with that block's key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_runtime.engine.kv_cache import BlockAllocator
from deepinfer_runtime.slot_pool import CacheSnapshot

_ROOT = b"deepinfer-prefix-v1"


def chain_hashes(tokens: list[int], block_size: int, prev: list[bytes] | None = None) -> list[bytes]:
    """Keys of every full block of ``tokens``; ``prev`` are keys already known for the first blocks."""
    keys = list(prev or [])
    for b in range(len(keys), len(tokens) // block_size):
        h = hashlib.blake2b(keys[-1] if keys else _ROOT, digest_size=16)
        h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[b * block_size : (b + 1) * block_size]))
        keys.append(h.digest())
    return keys


@dataclass
class PrefixHit:
    num_tokens: int
    blocks: list[int]
    snapshot: CacheSnapshot


@dataclass
class PrefixStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, blocks: BlockAllocator, max_snapshots: int, replay: int):
        self.blocks, self.block_size = blocks, blocks.block_size
        self.max_snapshots, self.replay = max_snapshots, max(replay, 1)
        self.by_key: dict[bytes, int] = {}
        self.snapshots: OrderedDict[bytes, CacheSnapshot] = OrderedDict()
        self.stats = PrefixStats()
        blocks.on_evict = self._evicted

    def _evicted(self, block: int, key: bytes) -> None:
        if self.by_key.get(key) == block:
            del self.by_key[key]
        snap = self.snapshots.pop(key, None)
        if snap is not None:
            snap.release()

    def lookup(self, tokens: list[int], keys: list[bytes]) -> PrefixHit | None:
        """The longest usable hit for a request whose known tokens are ``tokens`` (keys = their block keys).
        Acquires the hit's blocks (the caller owns one reference each)."""
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        limit = (len(tokens) - self.replay) // self.block_size
        n = 0
        while n < min(limit, len(keys)) and keys[n] in self.by_key:
            n += 1
        while n > 0 and keys[n - 1] not in self.snapshots:
            n -= 1
        if n == 0:
            return None
        snap = self.snapshots[keys[n - 1]]
        self.snapshots.move_to_end(keys[n - 1])
        hit = [self.by_key[k] for k in keys[:n]]
        for b in hit:
            self.blocks.acquire(b)
        self.stats.hit_tokens += n * self.block_size
        return PrefixHit(n * self.block_size, hit, snap)

    def register(self, keys: list[bytes], held: list[int], start: int) -> int:
        """Register the request's full blocks ``start .. len(keys)-1``; returns the new registered count.
        A key already cached under another block (two requests computed it at once) keeps the first."""
        for i in range(start, len(keys)):
            if keys[i] not in self.by_key:
                self.by_key[keys[i]] = held[i]
                self.blocks.hashed[held[i]] = keys[i]
        return len(keys)

    def add_snapshot(self, key: bytes, make: Callable[[], CacheSnapshot]) -> None:
        """File the snapshot ``make()`` takes under ``key`` (once per key), first dropping the least recently
        used one when all ``max_snapshots`` are taken, so that its slot is free for the new one."""
        if self.max_snapshots <= 0 or key not in self.by_key or key in self.snapshots:
            return
        while len(self.snapshots) >= self.max_snapshots:
            _, old = self.snapshots.popitem(last=False)
            old.release()
        self.snapshots[key] = make()

"""KV cache memory: exact accounting by cache kind and the block allocator behind the paged pools.

Every DeepSeek V4 / V4.1 cache kind is either fixed per request (window rings, compressor projection
rings, Engram lookback, DSpark context) or grows with the sequence (compressed KV, index keys). The budget
is split once at start-up: ``max_num_seqs`` request slots and ``snapshot_slots`` prefix-cache snapshot
slots of fixed state, ``layout.fixed_bytes`` each (the engine allocates exactly these as one
``slot_pool.SlotPool``), and the rest into blocks of ``block_size`` tokens of growing state. A block id
addresses the same block in every growing pool (``kv_pool.KVPools``); a request's block table covers
ceil(computed tokens / block_size) blocks; when none are free the scheduler preempts.

Blocks are reference counted so that prefix caching can share them. A block whose last holder lets
go goes back to the free list, or, if the prefix cache registered it (``hashed``), to an LRU list of
evictable blocks that a later request can still hit; allocation takes free blocks first and then
evicts the least recently used cached block (telling the prefix cache through ``on_evict``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_runtime.cache_layout import CacheLayout


class BlockAllocator:
    """Reference-counted allocator of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget fits no block of {block_size} tokens; raise kv_cache_memory")
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.hashed: dict[int, bytes] = {}  # block -> its prefix hash, while the prefix cache holds it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 and hashed; first = least recent
        self.on_evict: Callable[[int, bytes], None] = lambda block, h: None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, held: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(held) <= self.num_free

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self.on_evict(block, self.hashed.pop(block))
        self.ref[block] = 1
        return block

    def grow(self, held: list[int], num_tokens: int) -> None:
        """Extend ``held`` in place to cover ``num_tokens`` tokens (caller checked ``can_grow``)."""
        for _ in range(self.blocks_for(num_tokens) - len(held)):
            held.append(self._take())

    def acquire(self, block: int) -> None:
        """One more holder of a cached block (a prefix hit)."""
        if self.ref[block] == 0:
            del self._evictable[block]
        self.ref[block] += 1

    def release(self, held: list[int]) -> None:
        """Drop one reference to each block of ``held`` and clear it. The tail is released first so that,
        among one request's cached blocks, the deepest are evicted first (a prefix stays hittable longest)."""
        for block in reversed(held):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.hashed:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        held.clear()

    def check(self) -> None:
        """Invariant check (tests): every block is exactly one of free, evictable or held."""
        free, evict = set(self._free), set(self._evictable)
        held = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        assert not (free & evict) and not (free & held) and not (evict & held), "block in two states"
        assert len(free) + len(evict) + len(held) == self.num_blocks, "lost block"
        assert evict <= set(self.hashed), "evictable block without hash"


@dataclass(frozen=True)
class CacheBudget:
    """What fits: tokens of growing state, given a byte budget, the layout, the sequence cap and the
    number of prefix-cache snapshot slots (each the size of one request's fixed state, one slot of the
    ``SlotPool``)."""

    layout: CacheLayout
    budget_bytes: int
    max_num_seqs: int
    block_size: int
    snapshot_slots: int = 0

    @property
    def fixed_total(self) -> int:
        return (self.max_num_seqs + self.snapshot_slots) * self.layout.fixed_bytes

    @property
    def num_blocks(self) -> int:
        usable = self.budget_bytes - self.fixed_total
        per_block = max(self.layout.bytes_per_token * self.block_size, 1e-9)
        return max(int(usable // per_block), 0)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        snaps = f" + {self.snapshot_slots} prefix snapshots" if self.snapshot_slots else ""
        return (
            f"{self.layout.table()}\n"
            f"budget {self.budget_bytes / 2**20:,.1f} MiB: {self.max_num_seqs} request slots{snaps} "
            f"({self.fixed_total / 2**20:,.1f} MiB fixed) + {self.num_blocks:,} blocks "
            f"of {self.block_size} tokens = {self.num_tokens:,} tokens of context"
        )

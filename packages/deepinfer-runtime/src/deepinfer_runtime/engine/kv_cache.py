"""KV cache memory: exact accounting by cache kind and a block allocator the scheduler budgets with.

Every DeepSeek V4 / V4.1 cache kind is either fixed per request (window rings, compressor state,
Engram lookback, DSpark context) or grows with the sequence (compressed KV, index keys). The budget
is split once at start-up: ``max_num_seqs`` fixed slots, the rest into blocks of ``block_size`` tokens
of growing state. A request holds ceil(computed tokens / block_size) blocks; when none are free the
scheduler preempts.

Invariant: a request's block list only grows while it runs and is released whole when it finishes
or is preempted (recompute). The per-request tensors themselves live in the model's sequence caches;
the block ids are the accounting (and the future paged-pool addresses).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_runtime.cache_layout import CacheLayout


class BlockAllocator:
    """Free-list allocator of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget fits no block of {block_size} tokens; raise kv_cache_memory")
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, held: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(held) <= len(self._free)

    def grow(self, held: list[int], num_tokens: int) -> None:
        """Extend ``held`` in place to cover ``num_tokens`` tokens (caller checked ``can_grow``)."""
        for _ in range(self.blocks_for(num_tokens) - len(held)):
            held.append(self._free.pop())

    def release(self, held: list[int]) -> None:
        self._free.extend(reversed(held))
        held.clear()


@dataclass(frozen=True)
class CacheBudget:
    """What fits: tokens of growing state, given a byte budget, the layout and the sequence cap."""

    layout: CacheLayout
    budget_bytes: int
    max_num_seqs: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        usable = self.budget_bytes - self.max_num_seqs * self.layout.fixed_bytes
        per_block = max(self.layout.bytes_per_token * self.block_size, 1e-9)
        return max(int(usable // per_block), 0)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        return (
            f"{self.layout.table()}\n"
            f"budget {self.budget_bytes / 2**20:,.1f} MiB: {self.max_num_seqs} request slots "
            f"({self.max_num_seqs * self.layout.fixed_bytes / 2**20:,.1f} MiB fixed) + {self.num_blocks:,} blocks "
            f"of {self.block_size} tokens = {self.num_tokens:,} tokens of context"
        )

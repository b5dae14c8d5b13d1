"""Row stores for the growing cache kinds (compressed KV, index keys): standalone or paged.

A DeepSeek V4 / V4.1 compressor of ratio ``r`` emits one entry per ``r`` tokens; entry ``g`` covers
tokens [g*r, (g+1)*r). The model only appends entries and reads all of them, so each growing kind is
a ``RowStore`` with two implementations:

* ``TensorRows``: one growable tensor per request (amortised doubling). The model's own default, for
  ``forward`` / ``forward_logits`` without an engine.
* ``PagedRows``: rows live in a ``KVPool`` shared by all requests, [num_blocks, block_size // r, width],
  addressed through the request's block table (the scheduler's block ids, one table for every kind).
  Entry g sits in block ``table[g*r // block_size]`` at row ``(g*r % block_size) // r``. Full blocks are
  immutable, so prefix caching shares them between requests by sharing block ids.

Both return the same values from ``view()``; which one a cache uses is the engine's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from deepinfer_runtime.host_copy import host_tensor


class RowStore(Protocol):
    def __len__(self) -> int: ...

    def append(self, rows: torch.Tensor) -> None:
        """Append rows [k, width] (width and dtype fixed by the first append)."""

    def view(self) -> torch.Tensor | None:
        """All rows so far [n, width], or None before the first append."""

    def resume(self, n: int) -> None:
        """Continue after the first ``n`` rows, already present in this store's blocks (prefix hit)."""

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` rows (speculative rollback); later appends overwrite the rest."""


class TensorRows:
    """A growable [n, width] tensor with amortised doubling (no O(n^2) re-concatenation)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, rows: torch.Tensor) -> None:
        n, k = self._n, rows.shape[0]
        if self._buf is None or n + k > self._buf.shape[0]:
            cap = max(2 * (0 if self._buf is None else self._buf.shape[0]), n + k, 16)
            buf = rows.new_empty(cap, *rows.shape[1:])
            if self._buf is not None:
                buf[:n] = self._buf[:n]
            self._buf = buf
        self._buf[n : n + k] = rows
        self._n = n + k

    def view(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[: self._n]

    def resume(self, n: int) -> None:
        raise RuntimeError("standalone caches cannot resume from a snapshot: prefix caching needs paged stores")

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._n:
            raise ValueError(f"truncate to {n} rows of {self._n}")
        self._n = n


class KVPool:
    """One growing kind's storage for every request: ``data`` [num_blocks, block_size // ratio, width], a view of
    ``flat`` [num_blocks * rows_per_block + 1, width] whose last row is scratch (``scratch_row``: where a batched
    decode step stores the entries of requests that complete none)."""

    def __init__(self, num_blocks: int, block_size: int, ratio: int, width: int, dtype: torch.dtype, device):
        if block_size % ratio:
            raise ValueError(f"block_size {block_size} is not a multiple of compression ratio {ratio}")
        self.block_size, self.ratio, self.rows_per_block = block_size, ratio, block_size // ratio
        self.scratch_row = num_blocks * self.rows_per_block
        self.flat = torch.empty(self.scratch_row + 1, width, dtype=dtype, device=device)
        self.data = self.flat[:-1].view(num_blocks, self.rows_per_block, width)


class KVPools:
    """The pools of one engine, created on first use per cache key (width and dtype come from the model)."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.pools: dict[object, KVPool] = {}

    def get(self, key: object, ratio: int, width: int, dtype: torch.dtype) -> KVPool:
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = KVPool(self.num_blocks, self.block_size, ratio, width, dtype, self.device)
        return pool

    def factory(self, table: list[int]) -> Callable[[object, int], PagedRows]:
        """Row stores of one request: ``table`` is its block id list (shared, grown by the scheduler)."""
        return lambda key, ratio: PagedRows(self, key, ratio, table)


class PagedRows:
    """A request's rows of one kind inside a ``KVPool``, through its block table."""

    def __init__(self, pools: KVPools, key: object, ratio: int, table: list[int], n: int = 0):
        self.pools, self.key, self.ratio, self.table = pools, key, ratio, table
        self.pool: KVPool | None = None
        self._n = n

    def __len__(self) -> int:
        return self._n

    def resume(self, n: int) -> None:
        self._n = n

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._n:
            raise ValueError(f"truncate to {n} rows of {self._n}")
        self._n = n

    def _slots(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(start, stop)
        rpb = self.pool.rows_per_block
        if (stop - 1) // rpb >= len(self.table):
            raise RuntimeError(
                f"cache {self.key}: row {stop - 1} needs block {(stop - 1) // rpb} but the table holds "
                f"{len(self.table)} blocks (the scheduler must grow the table before the step)"
            )
        # built on the host, sent in one pinned non-blocking copy (a pageable copy would wait for the device)
        blocks = torch.tensor(self.table, dtype=torch.long)[idx // rpb]
        both = host_tensor(torch.stack([blocks, idx % rpb]), torch.long, self.pool.data.device)
        return both[0], both[1]

    def append(self, rows: torch.Tensor) -> None:
        if self.pool is None:
            self.pool = self.pools.get(self.key, self.ratio, rows.shape[-1], rows.dtype)
        k = rows.shape[0]
        if k:
            blocks, offs = self._slots(self._n, self._n + k)
            self.pool.data[blocks, offs] = rows.to(self.pool.data.dtype)
        self._n += k

    def view(self) -> torch.Tensor | None:
        if self.pool is None:
            self.pool = self.pools.pools.get(self.key)
            if self.pool is None:
                return None
        if not self._n:
            return self.pool.data.new_zeros(0, self.pool.data.shape[-1])
        blocks, offs = self._slots(0, self._n)
        return self.pool.data[blocks, offs]

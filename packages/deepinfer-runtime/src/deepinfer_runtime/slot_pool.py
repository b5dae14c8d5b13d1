"""The fixed-size cache kinds of every request in one preallocated pool of slots, rows addressed by position.

A DeepSeek V4 / V4.1 request keeps, besides its growing rows (``kv_pool``), state of a fixed size: sliding-window
latents, compressor projections of the incomplete group (and, for speculative rollback, the rows behind it), the
Engram lookback and the DSpark context. The model declares each such buffer as a ``SlotSpec`` (rows x width of a
dtype, per layer); a ``SlotPool`` allocates every one of them once, [num_slots, rows, width] on the device, and
hands out slot indices from free lists: ``num_requests`` slots for running requests (one per request for its
life) and ``num_snapshots`` for prefix-cache snapshots. Nothing is allocated per step.

Inside a slot, a ``Ring`` holds one kind's rows by position: position p lives in row p % rows, written in place
(``index_copy_``) and gathered back in position order. A ring keeps the positions [lo, end): writing moves both
forward, a speculative rollback of n tokens moves ``end`` back (the rows it uncovers were never overwritten as long
as n <= the B spare rows the spec reserves). ``SlotState`` is one claimed slot with its rings: snapshot = copy
the slot into a snapshot slot on the device (ring bounds are plain ints), restore = copy it back into a new
request slot. A model used without an engine backs its cache with a private one-slot pool: one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotSpec:
    """One fixed buffer of one request: ``rows`` x ``width`` values of ``dtype``, accounted under cache kind
    ``kind`` (a ``cache_layout.CacheKind`` name); ``key`` names it inside the slot (e.g. ("window", layer))."""

    key: object
    kind: str
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * torch.empty(0, dtype=self.dtype).element_size()


class Ring:
    """One kind's rows of one slot by position: ``buf`` [R, width] (a view into the pool) holds positions
    [lo, end), position p in row p % R."""

    def __init__(self, buf: torch.Tensor, lo: int = 0, end: int = 0):
        self.buf, self.lo, self.end = buf, lo, end

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    def __len__(self) -> int:
        return self.end - self.lo

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        rows = torch.arange(lo, hi, device=self.buf.device)
        return rows % self.capacity if self.capacity else rows

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store rows [k, width] of positions start .. start + k - 1 (only the last R survive). A start past
        ``end`` drops the older rows: they are no longer contiguous with the new ones (compact YOCO)."""
        k = rows.shape[0]
        keep = min(k, self.capacity)
        self.advance(start, k)
        if keep:
            self.buf.index_copy_(0, self._rows(start + k - keep, start + k), rows[k - keep :].to(self.buf.dtype))

    def advance(self, start: int, k: int) -> None:
        """The bounds after writing ``k`` rows at ``start`` (``write`` without the rows: a caller that stores
        them itself, batched over requests)."""
        Ring.advance_each([self], [start], k)

    @staticmethod
    def advance_each(rings: list[Ring], starts: list[int], k: int = 1) -> None:
        """``ring.advance(p, k)`` for each ring and its position p, rings of one buffer (one capacity), in one loop
        (a decode step plans thousands of them). A start past ``end`` restarts the ring there."""
        cap = rings[0].capacity if rings else 0
        for r, p in zip(rings, starts):
            if p < r.end:
                raise RuntimeError(f"ring write at position {p} behind its end {r.end} (roll back first)")
            lo = r.lo if p == r.end else p
            r.end = p + k
            r.lo = lo if lo > p + k - cap else p + k - cap

    @staticmethod
    def follow(rings: list[Ring], lead: list[Ring], before: list[tuple[int, int]], after: list[tuple[int, int]]):
        """Move each ring as its lead ring moved, from (lo, end) ``before`` to ``after``, where every ring held what
        its lead held before and has its capacity: rings that always move together (a request's windows of every
        layer, a compressor's kv and score rings) advance once, not once per ring. Returns False, changing nothing,
        where any ring differs."""
        if rings and (rings[0].capacity != lead[0].capacity or [(r.lo, r.end) for r in rings] != before):
            return False
        for r, bounds in zip(rings, after):
            r.lo, r.end = bounds
        return True

    @staticmethod
    def first_held(rings: list[Ring], starts: list[int], back: int) -> list[int]:
        """For a write at each ring's position p: the first of the ``back`` positions before p that the ring still
        holds (p itself when it holds none: a ring whose end is not p restarts there)."""
        return [max(r.lo, p - back) if r.end == p else p for r, p in zip(rings, starts)]

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Rows of positions lo .. hi - 1 in position order [hi - lo, width] (a gathered copy)."""
        if not self.lo <= lo <= hi <= self.end:
            raise RuntimeError(f"ring read of positions [{lo}, {hi}) outside the held [{self.lo}, {self.end})")
        return self.buf[self._rows(lo, hi)]

    def view(self) -> torch.Tensor:
        """Every held row in position order."""
        return self.read(self.lo, self.end)

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` positions."""
        self.end -= n
        self.lo = min(self.lo, self.end)


class SlotPool:
    """Every fixed buffer of ``specs`` for ``num_requests + num_snapshots`` slots: ``buffers[key]`` is
    [num_slots, rows, width] of the spec's dtype on ``device``. Slots 0 .. num_requests - 1 are request slots,
    then the snapshot slots, and one last slot, ``scratch``, never handed out: the rows a batched decode step
    pads its batch with write there (``decode_batch``)."""

    def __init__(self, specs: list[SlotSpec], num_requests: int, num_snapshots: int, device: torch.device | str):
        keys = [s.key for s in specs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"slot specs with the same key: {keys}")
        self.specs, self.num_requests, self.num_snapshots = list(specs), num_requests, num_snapshots
        n = num_requests + num_snapshots
        self.scratch = n
        self.buffers = {s.key: torch.zeros(n + 1, s.rows, s.width, dtype=s.dtype, device=device) for s in specs}
        self._free = {
            "request": list(range(num_requests - 1, -1, -1)),
            "snapshot": list(range(n - 1, num_requests - 1, -1)),
        }

    @classmethod
    def private(cls, specs: list[SlotSpec], device: torch.device | str) -> SlotState:
        """One request slot of a pool of its own (a model run without an engine)."""
        return cls(specs, 1, 0, device).claim()

    @property
    def bytes_per_slot(self) -> int:
        """Bytes the buffers hold per slot (what ``CacheBudget`` reserves as ``layout.fixed_bytes``)."""
        return sum(b[0].nbytes for b in self.buffers.values())

    def num_free(self, role: str = "request") -> int:
        return len(self._free[role])

    def claim(self, role: str = "request") -> SlotState:
        """A free slot of ``role`` ("request" or "snapshot") with empty rings."""
        free = self._free[role]
        if not free:
            total = self.num_requests if role == "request" else self.num_snapshots
            raise RuntimeError(
                f"no free {role} slot: all {total} are held"
                + (" (more live request caches than max_num_seqs)" if role == "request" else "")
            )
        return SlotState(self, free.pop(), role)

    def _release(self, slot: int, role: str) -> None:
        self._free[role].append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Every buffer's rows of slot ``src`` into slot ``dst`` (on the device, queued in stream order)."""
        for buf in self.buffers.values():
            buf[dst].copy_(buf[src])


class SlotState:
    """A claimed slot of a ``SlotPool`` and its rings (bounds per key). Released exactly once."""

    def __init__(self, pool: SlotPool, slot: int, role: str):
        self.pool, self.slot, self.role = pool, slot, role
        self.rings = {key: Ring(buf[slot]) for key, buf in pool.buffers.items()}
        self._held = True

    def __getitem__(self, key: object) -> Ring:
        return self.rings[key]

    def __contains__(self, key: object) -> bool:
        return key in self.rings

    def copy_to(self, role: str) -> SlotState:
        """A newly claimed slot of ``role`` holding a copy of this one's rows and ring bounds."""
        other = self.pool.claim(role)
        self.pool.copy_slot(self.slot, other.slot)
        for key, ring in self.rings.items():
            other.rings[key].lo, other.rings[key].end = ring.lo, ring.end
        return other

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pool._release(self.slot, self.role)


@dataclass
class CacheSnapshot:
    """A request cache at a block boundary, for prefix caching: ``slots`` a snapshot slot holding a copy of its
    fixed-size state (rings with their bounds), ``meta`` the cache's scalar fields (seq_len, ...), ``lengths``
    (ratio, rows) per growing store. The growing rows themselves are not copied: they are the pool blocks the
    prefix cache keeps alive. ``release`` gives the slot back (when the prefix cache drops the snapshot)."""

    slots: SlotState
    meta: dict
    lengths: dict

    def release(self) -> None:
        self.slots.release()


def check_rollback(num_tokens: int, backtrack: int) -> None:
    """A speculative rollback may undo at most the B tokens the rings keep spare rows for."""
    if num_tokens > backtrack:
        raise RuntimeError(f"rollback of {num_tokens} tokens exceeds the cache's backtrack ring B = {backtrack}")


def append_window(ring: Ring, kv: torch.Tensor, window: int, start: int) -> tuple[torch.Tensor, int]:
    """Sliding-window append shared by the models: window latents kv [S, D] of positions start .. start + S - 1
    go into ``ring``; returns the rows their queries attend over, [held rows of the W - 1 positions before start
    | kv], and the position of row 0."""
    first = Ring.first_held([ring], [start], window - 1)[0]
    rows = torch.cat([ring.read(first, start), kv]) if first < start else kv
    ring.write(start, kv)  # after the read: a long chunk overwrites the rows it attends to
    return rows, first

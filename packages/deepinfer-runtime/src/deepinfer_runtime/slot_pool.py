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
the slot into a snapshot slot on the device (the ring bounds, host ints in the pool's bounds table, copied on
the host), restore = copy it back into a new request slot. A claimed slot's rings start empty. A model used
without an engine backs its cache with a private one-slot pool: one code path.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

# a decode step moves up to this many (request, ring) bounds in Python ints; more in a few tensor operations
# (each costs ~10 us on the host, the ints ~0.2 us apiece)
LOOP_RINGS = 256


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
    [lo, end), position p in row p % R. The bounds live in the pool's bounds table (``SlotPool.bounds``, where a
    decode step's plan moves every request's rings at once) or, for a ring made alone, in a private one."""

    def __init__(self, buf: torch.Tensor, lo: int = 0, end: int = 0, bounds: array.array | None = None, at: int = 0):
        self.buf = buf
        self._bounds, self._at = (array.array("q", (0, 0)), 0) if bounds is None else (bounds, at)
        self.lo, self.end = lo, end

    @property
    def lo(self) -> int:
        return self._bounds[self._at]

    @lo.setter
    def lo(self, value: int) -> None:
        self._bounds[self._at] = value

    @property
    def end(self) -> int:
        return self._bounds[self._at + 1]

    @end.setter
    def end(self, value: int) -> None:
        self._bounds[self._at + 1] = value

    def move_into(self, other: Ring) -> None:
        """Take over ``other``'s rows and bounds storage (another slot's ring of the same key), carrying this
        ring's rows and bounds there: the objects that hold this ring keep it, now living in ``other``'s slot."""
        other.buf.copy_(self.buf)
        other.lo, other.end = self.lo, self.end
        self.buf, self._bounds, self._at = other.buf, other._bounds, other._at

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
        them itself). A start past ``end`` restarts the ring there."""
        lo, end, cap = self.lo, self.end, self.capacity
        if start < end:
            raise RuntimeError(f"ring write at position {start} behind its end {end} (roll back first)")
        self.lo, self.end = max(lo if start == end else start, start + k - cap), start + k

    def first_held(self, start: int, back: int) -> int:
        """For a write at position ``start``: the first of the ``back`` positions before it that the ring still
        holds (``start`` itself when it holds none: a ring whose end is not ``start`` restarts there)."""
        return max(self.lo, start - back) if self.end == start else start

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
        # every ring's bounds (lo, end) by slot and key, in one int64 table: plain ints for a ring's own reads and
        # writes (``Ring``), and one tensor view over the same memory for a decode step's plan, which moves the
        # rings of every request and layer at once (``step_rings``) instead of one Python object at a time
        self.ring_index = {key: i for i, key in enumerate(keys)}
        self._bounds = array.array("q", bytes(16 * (n + 1) * len(keys)))
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

    @property
    def bounds(self) -> torch.Tensor:
        """[num_slots, ring keys, 2] int64 (lo, end): a tensor view of the rings' bounds table (same memory)."""
        flat = torch.frombuffer(self._bounds, dtype=torch.int64) if self._bounds else torch.zeros(0, dtype=torch.long)
        return flat.view(self.scratch + 1, len(self.ring_index), 2)

    def step_rings(
        self, keys: list, slots: torch.Tensor, starts: torch.Tensor, back: int
    ) -> list[tuple[list, list[int]]]:
        """A decode step writes one row at each request's position p (``starts``) into rings ``keys`` of its slot
        (``slots``; both [B] int64 on the CPU) and reads the ``back`` rows before it: every ring advances as
        ``Ring.advance(p, 1)`` would. Returns the keys in groups whose rings held the same positions for every
        request and have one capacity (normally one group: every layer's window, a compressor kind's rings), each
        with the first position of those ``back`` rows that its rings still hold, per request (``Ring.first_held``).
        A write behind a ring's end is refused before any ring moves."""
        caps = [self.buffers[k].shape[1] for k in keys]
        at = [self.ring_index[k] for k in keys]
        small = len(slots) * len(keys) <= LOOP_RINGS
        rows = slots.tolist() if small else slots
        groups = self._ring_groups_loop(at, caps, rows) if small else self._ring_groups_tensor(at, caps, slots)
        out, moves = [], []
        for group in groups:  # every group is checked before any ring moves
            firsts, move = self._step_group([at[j] for j in group], caps[group[0]], slots, starts, back, keys[group[0]])
            out.append(([keys[j] for j in group], firsts))
            moves.append(move)
        for move in moves:
            move()
        return out

    def _ring_groups_loop(self, at: list[int], caps: list[int], slots: list[int]) -> list[list[int]]:
        b, width = self._bounds, 2 * len(self.ring_index)
        rows = [s * width for s in slots]
        groups: list[list[int]] = []
        for j, a in enumerate(at):
            for g in groups:
                lead = 2 * at[g[0]]
                if caps[g[0]] == caps[j] and all(
                    b[r + 2 * a] == b[r + lead] and b[r + 2 * a + 1] == b[r + lead + 1] for r in rows
                ):
                    g.append(j)
                    break
            else:
                groups.append([j])
        return groups

    def _ring_groups_tensor(self, at: list[int], caps: list[int], slots: torch.Tensor) -> list[list[int]]:
        held = self.bounds.index_select(0, slots).index_select(1, torch.tensor(at))  # [B, keys, (lo, end)]
        if len(set(caps)) == 1 and torch.equal(held, held[:, :1].expand_as(held)):
            return [list(range(len(at)))]  # the usual case: one group
        # keys whose rings hold alike for every request: equal columns of held
        alike = torch.unique(held.transpose(0, 1).reshape(len(at), -1), dim=0, return_inverse=True)[1].tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for j, (u, cap) in enumerate(zip(alike, caps)):
            groups.setdefault((u, cap), []).append(j)
        return list(groups.values())

    def _step_group(
        self, at: list[int], cap: int, slots: torch.Tensor, starts: torch.Tensor, back: int, name: object
    ) -> tuple[list[int], Callable[[], None]]:
        """For rings ``at`` (ring indices, held alike) of each slot and a write at its start: the first held
        positions, and the move of the bounds (called once every group has been checked)."""
        width = len(self.ring_index)
        if len(slots) * len(at) <= LOOP_RINGS:
            b, firsts, moves = self._bounds, [], []
            for s, p in zip(slots.tolist(), starts.tolist()):
                r = 2 * (s * width + at[0])
                lo, end = b[r], b[r + 1]
                if p < end:
                    raise RuntimeError(f"ring {name}: write at position {p} behind its end {end}")
                firsts.append(p if end != p else max(lo, p - back))
                moves.append((2 * s * width, max(lo if end == p else p, p + 1 - cap), p + 1))

            def move_loop() -> None:
                for row, lo, end in moves:
                    for a in at:
                        b[row + 2 * a], b[row + 2 * a + 1] = lo, end

            return firsts, move_loop
        flat = self.bounds.view(-1, 2)
        lo, end = flat.index_select(0, slots * width + at[0]).unbind(1)
        behind = starts < end
        if bool(behind.any()):
            i = int(behind.nonzero()[0, 0])
            raise RuntimeError(f"ring {name}: write at position {int(starts[i])} behind its end {int(end[i])}")
        restart = end != starts
        firsts = torch.where(restart, starts, torch.maximum(lo, starts - back))
        new = torch.stack([torch.maximum(torch.where(restart, starts, lo), starts + 1 - cap), starts + 1], 1)
        idx = (slots[:, None] * width + torch.tensor(at)).view(-1)
        return firsts.tolist(), lambda: flat.index_copy_(0, idx, new[:, None].expand(-1, len(at), -1).reshape(-1, 2))

    def copy_slot(self, src: int, dst: int) -> None:
        """Every buffer's rows of slot ``src`` into slot ``dst`` (on the device, queued in stream order)."""
        for buf in self.buffers.values():
            buf[dst].copy_(buf[src])


class SlotState:
    """A claimed slot of a ``SlotPool`` and its rings (bounds per key). Released exactly once."""

    def __init__(self, pool: SlotPool, slot: int, role: str):
        self.pool, self.slot, self.role = pool, slot, role
        width = 2 * len(pool.ring_index)
        self.rings = {
            key: Ring(buf[slot], bounds=pool._bounds, at=slot * width + 2 * pool.ring_index[key])
            for key, buf in pool.buffers.items()
        }
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
    first = ring.first_held(start, window - 1)
    rows = torch.cat([ring.read(first, start), kv]) if first < start else kv
    ring.write(start, kv)  # after the read: a long chunk overwrites the rows it attends to
    return rows, first

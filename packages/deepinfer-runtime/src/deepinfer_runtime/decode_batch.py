"""A decode step of many requests as one batch, planned on the host and run with static shapes on the device.

The models' general path runs attention request by request (chunks of any length, each against its own cache),
which costs each request a few dozen small kernels per layer. In a decode step every request adds exactly one
row, and when the requests live in the engine's pools (one ``SlotPool`` for the fixed-size rings, paged rows in
one ``KVPools`` for the growing kinds) the per-request work is only addressing: request b's ring rows are at
``buffers[key][slot_b, p % R]``, its entries in the blocks of its table.

A ``DecodeBatch`` splits the step in two:

* the plan (host, ``plan_*``): for each ring and row store the model names, it reads each request's bounds and
  lengths, advances them as the step will, and records what the device needs (positions, slots, how far back
  each ring holds, the row each newly completed entry goes to, block tables) in one int64 list, sent to the
  device in one copy (``seal``). Rings and stores that move together (every layer's window, the compressors of
  one kind) are planned once and share their fields; the rings' bounds of every request and layer move together
  in a few tensor operations on the slot pool's bounds table (``SlotPool.step_rings``);
* the device work (``write``, ``ring_ids``, ``window``, ``append``, ``pages``, ``pool_rows``): scatters and
  row ids (one kernel per call: ``ring_scatter`` / ``scatter_rows`` / ``ring_rows`` / ``paged_rows`` of
  ``deepinfer_kernels``) whose shapes depend only on the batch rows and the table width, and which read only that
  tensor, so a whole step can be captured in a CUDA graph once and replayed with the data of a later plan of the
  same ``shape_key`` (``rebind``, ``run``).

Rows past ``size`` (padding up to a graph's batch bucket) address the pools' scratch slot and scratch row.
Nothing is gathered for attention or the compressors: a ring keeps its newest row too, so after the step's write
the window and a compressor's group are read in place from the slot pool's buffers (``ring_ids``), and attention
reads the compressed entries it selects in place, from the pool (``pool_rows``). The indexer scores every
request's index keys up to the table width in place too (``pages``: ``rows_per_block`` x blocks), the rows past a
request's own length masked by visibility.
"""

from __future__ import annotations

import array
import copy
import math
import struct

import torch
from deepinfer_kernels import paged_rows, ring_rows, ring_scatter, scatter_rows

from deepinfer_runtime.cuda_graphs import StepGraphs
from deepinfer_runtime.host_copy import long_tensor
from deepinfer_runtime.kv_pool import KVPool, KVPools, PagedRows, RowStore
from deepinfer_runtime.slot_pool import SlotPool

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
TABLE_BUCKET = 8  # with graphs the table width rounds up to a multiple of this many blocks (fewer captures)


def batch_bucket(n: int) -> int:
    """The graph batch size serving ``n`` requests (``n`` itself past the largest bucket)."""
    return next((b for b in BATCH_BUCKETS if b >= n), n)


def paged_stores(stores: list[RowStore]) -> KVPools | None:
    """The ``KVPools`` every store pages into, or None when they are not all pages of one engine's pools."""
    pools = getattr(stores[0], "pools", None) if stores else None
    ok = pools is not None and all(isinstance(s, PagedRows) and s.pools is pools for s in stores)
    return pools if ok else None


class DecodeBatch:
    """One decode step of ``size`` requests over the slots of ``pool``; with ``graphs`` (that apply to the step)
    its device rows are padded to the batch bucket (``rows``) and ``run`` replays it from them."""

    def __init__(self, starts: list[int], slots: list[int], pool: SlotPool, graphs: StepGraphs | None = None):
        self.starts, self.size = list(starts), len(starts)
        device = next(iter(pool.buffers.values())).device
        bucket = batch_bucket(self.size)
        self.graphs = graphs if graphs is not None and graphs.applies(bucket, device) else None
        self.rows = bucket if self.graphs is not None else self.size
        self.pad = self.rows - self.size
        self.pool, self.buffers = pool, pool.buffers
        self._starts, self._slot_ids = torch.tensor(self.starts), torch.tensor(slots)
        self.kv: dict[object, KVPool] = {}  # store key -> its pool
        self.back: dict[object, int] = {}  # ring buffer key -> the rows the step reads behind the new one
        self.layout: dict[object, tuple[int, tuple[int, ...]]] = {}
        # int64 values filled from Python ints in C loops (``array``): torch.tensor(list) is ~3x slower per int,
        # and a step at batch 256 and 32K tokens sends ~70K of them (the block tables)
        self._values = array.array("q")
        self.put("pos", self.starts + [0] * self.pad)
        self.put("slots", list(slots) + [pool.scratch] * self.pad)
        self.data: torch.Tensor | None = None

    # --- host: the plan ----------------------------------------------------------------------------------
    def put(self, names: object | list, values: list[int], width: int = 0) -> None:
        """Record ``values`` ([rows] ints, or [rows x width] row-major) as field ``names`` (a list: one field
        read under several names)."""
        shape = (self.rows, width) if width else (self.rows,)
        for name in names if isinstance(names, list) else [names]:
            self.layout[name] = (len(self._values), shape)
        self._values.extend(values)

    def plan_positions(self, ratios) -> None:
        """The position arithmetic of the step's compressors and indexers, per compression ratio r >= 1, done on the
        host (on the device each is two or three int64 kernels a layer): ("pos_mod", r) = p % r (a compressor's
        position-bias row), ("group_start", r) = p + 1 - r (the first position of the group the step completes)
        and ("visible", r) = (p + 1) // r (the entries a request sees after the step); padding rows as p = 0."""
        ps = self.starts + [0] * self.pad
        for r in sorted({r for r in ratios if r >= 1}):
            self.put(("pos_mod", r), [p % r for p in ps])
            self.put(("group_start", r), [p + 1 - r for p in ps])
            self.put(("visible", r), [(p + 1) // r for p in ps])

    def plan_ring(self, keys: list, back: int) -> None:
        """The step writes one row per request at its position p into the rings of slot-pool buffers ``keys`` and
        reads the ``back`` rows before it (in place, after the write: ``ring_ids``): record from which position
        each request's rings hold them, then advance the bounds. A ring holds [lo, end); one whose end is not p
        restarts at p (``Ring.write``), so it holds nothing before.

        Keys whose rings move together (every layer's window, compressors of one kind) share one recorded field;
        a key whose rings hold other positions gets its own. The bounds of every request and key move in a few
        tensor operations (``SlotPool.step_rings``), not ring by ring."""
        for names, firsts in self.pool.step_rings(keys, self._slot_ids, self._starts, back):
            self.back.update(dict.fromkeys(names, back))
            self.put([("first", key) for key in names], firsts + [0] * self.pad)

    def plan_append(
        self, stores: dict[object, list[PagedRows]], ratio: int, widths: dict[object, int], dtype: torch.dtype
    ) -> None:
        """Compressors of ``ratio`` complete an entry for the requests at positions p with (p + 1) % ratio == 0:
        per store key (``stores[key]``: one store per request, entries ``widths[key]`` wide) record the pool row
        each such entry goes to (the scratch row for the others) and count it. A request's stores page through
        one block table, and every pool of a ratio has the same rows per block and scratch row, so keys whose
        stores hold as many entries (every compressor of one ratio, normally) get the same rows: one field."""
        done = [i for i, p in enumerate(self.starts) if (p + 1) % ratio == 0]
        kinds: dict[tuple[int, ...], list] = {}  # the completing requests' entry counts -> keys
        for key, group in stores.items():
            kinds.setdefault(tuple([len(group[i]) for i in done]), []).append(key)
        for lengths, keys in kinds.items():
            pools = [stores[k][0].pools.get(k, ratio, widths[k], dtype) for k in keys]
            rpb, scratch = pools[0].rows_per_block, pools[0].scratch_row
            lead, targets = stores[keys[0]], [scratch] * self.size
            for i, n in zip(done, lengths):
                table = lead[i].table
                if n // rpb >= len(table):
                    raise RuntimeError(
                        f"cache {keys[0]}: row {n} needs block {n // rpb} but the table holds {len(table)} blocks "
                        "(the scheduler must grow the table before the step)"
                    )
                targets[i] = table[n // rpb] * rpb + n % rpb
            for key, pool in zip(keys, pools):
                self.kv[key], group = pool, stores[key]
                for i, n in zip(done, lengths):
                    group[i].pool = pool
                    group[i].resume(n + 1)
            self.put([("emit", key) for key in keys], targets + [scratch] * self.pad)

    def plan_tables(self, tables: list[list[int]], block_size: int, bucket: bool) -> None:
        """Each request's block table, as far as its entries after this step reach (the widest of the batch;
        with ``bucket`` rounded up to ``TABLE_BUCKET`` blocks so that graphs serve many steps)."""
        width = max(-(-(p + 1) // block_size) for p in self.starts)
        if bucket:
            width = -(-width // TABLE_BUCKET) * TABLE_BUCKET
        # blocks past a request's table read block 0: rows it does not own, never visible to it
        start = len(self._values)
        self.layout["tables"] = (start, (self.rows, width))
        self._values.frombytes(bytes(8 * self.rows * width))  # zeros, then each table's first blocks over them
        # packed straight from the lists: an array of each list first took twice as long (256 tables of 257 blocks,
        # 1.38 -> 0.78 ms on the development CPU; the H200's host is 2-3x slower a core, and V4's step at batch 256
        # and 32K tokens was host-bound there)
        with memoryview(self._values) as raw, raw.cast("B") as out:
            for i, t in enumerate(tables):
                n = min(len(t), width)
                struct.pack_into(f"{n}q", out, 8 * (start + i * width), *(t[:n] if n < len(t) else t))

    def seal(self, device: torch.device) -> DecodeBatch:
        """Send the plan to the device (one pinned copy)."""
        self.data = long_tensor(torch.frombuffer(self._values, dtype=torch.int64), device)
        return self

    @property
    def shape_key(self) -> tuple:
        """What a captured step depends on: plans with equal keys can replay each other's graphs."""
        return self.rows, len(self._values), frozenset(self.layout.items())

    def run(self, ids: torch.Tensor, fn) -> torch.Tensor:
        """The step's device work ``fn(batch, ids [rows]) -> logits [rows, V]`` for the step's token ids [size]
        (padded here to the batch rows), through the step's graphs where it has them."""
        if self.graphs is None:
            return fn(self, ids)
        if self.pad:
            ids = torch.cat([ids, ids.new_zeros(self.pad)])
        return self.graphs.run(self.shape_key, lambda data, i: fn(self.rebind(data), i), self.data, ids)

    def per_request(self, logits: torch.Tensor, logit_rows: list[torch.Tensor | None] | None) -> list[torch.Tensor]:
        """Each request's logits out of the step's [rows, V]: its one row, or none where ``logit_rows[i]`` (the
        models' ``forward_step`` argument: offsets into a one-token chunk) is empty."""
        if logit_rows is None or all(r is None for r in logit_rows):
            return list(logits[: self.size].split(1))  # the views made in one call (a step at batch 256 takes 256)
        return [logits[j : j + (1 if r is None else r.numel())] for j, r in enumerate(logit_rows)]

    def rebind(self, data: torch.Tensor) -> DecodeBatch:
        """This plan reading ``data`` (a graph's static copy of another plan's ``data`` of the same shape)."""
        out = copy.copy(self)
        out.data = data
        return out

    # --- device: static-shape gathers and scatters ---------------------------------------------------------
    def __getitem__(self, name: object) -> torch.Tensor:
        off, shape = self.layout[name]
        return self.data[off : off + math.prod(shape)].view(shape)

    def write(
        self, key: object, rows: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Write ``rows`` [rows, C] at each request's position p into ring buffer ``key``; return the buffer as one
        row table [num_slots x R, C] (what ``ring_ids`` addresses, read in place). ``bias`` = (table [N, C], index
        [rows]): write rows + table[index] instead (``ring_scatter``'s bias, the same launch)."""
        buf = self.buffers[key]
        b, i = bias if bias is not None else (None, None)
        # one kernel: the row (plus its bias row), its ring index and the cast
        ring_scatter(buf, rows, self["slots"], self["pos"], bias=b, bias_index=i)
        return buf.view(-1, buf.shape[-1])

    def ring_ids(self, key: object, n: int, every: int = 1) -> torch.Tensor:
        """[rows, n] int64: the rows of ring buffer ``key``'s table (``write``) holding each request's positions
        p - n + 1 .. p after this step's write, -1 for a position the ring does not hold. With ``every`` only the
        requests whose p + 1 is a multiple of it get rows (a compressor's group completes there), the others -1.
        The ring must keep n rows (so the write did not overwrite the oldest) and the plan must look ``n - 1`` rows
        back. One kernel (``ring_rows``)."""
        cap = self.buffers[key].shape[1]
        if cap < n or self.back[key] < n - 1:
            raise RuntimeError(
                f"ring {key}: reading {n} positions in place needs {n} rows and a plan {n - 1} rows back "
                f"(has {cap} rows, planned {self.back[key]})"
            )
        return ring_rows(self["pos"], self["slots"], self[("first", key)], cap, n, every)

    def window(self, key: object, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding-window keys: append the new latents kv [rows, D] to window ring buffer ``key`` (planned with
        ``back`` = W - 1, W + B rows); return its row table [num_slots x R, D], read in place, and the rows of each
        request's last W positions in it [rows, W] (positions p - W + 1 .. p; -1: a position not held)."""
        table = self.write(key, kv)
        return table, self.ring_ids(key, self.back[key] + 1)

    def window_rows(self, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        """``window`` without the write: window ring ``key``'s row table [num_slots x R, D] and the rows of each
        request's last W positions in it [rows, W], read from the plan alone (so a step makes them before the
        latents exist). Column W - 1 is the row this step's latent goes to (the position p itself, always held):
        where the caller stores it (``rms_norm_rope``'s ``out_rows``)."""
        buf = self.buffers[key]
        return buf.view(-1, buf.shape[-1]), self.ring_ids(key, self.back[key] + 1)

    def append_rows(self, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``append`` stores: store ``key``'s pool rows [N, C] and each request's row of it [rows] (for ops
        that store their output rows themselves)."""
        return self.kv[key].flat, self[("emit", key)]

    def append(self, key: object, rows: torch.Tensor) -> None:
        """Store each request's newly completed entry rows [rows, C] of store ``key`` where the plan put it."""
        pool = self.kv[key]
        scatter_rows(pool.flat, rows, self[("emit", key)])

    def entry_capacity(self, key: object) -> int:
        """Entries of store ``key`` a request's table reaches (table width x rows per block)."""
        return self.layout["tables"][1][1] * self.kv[key].rows_per_block

    def pages(self, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``'s pool [num_blocks, rows per block, C] and the block tables [rows, width]: entry n of
        request b is ``pool[tables[b, n // R], n % R]``, meaningful for n below its length (what the indexer reads
        in place, ``indexer_scores_paged``)."""
        return self.kv[key].data, self["tables"]

    def pool_rows(
        self, key: object, ids: torch.Tensor | int, offset: int = 0, *, limit=None, prefix=None
    ) -> torch.Tensor:
        """[rows, K] int64: rows of store ``key``'s pool (``kv[key].flat``) holding each request's entries ``ids``
        [rows, K] int64 (its own entry numbers through its table; -1 stays -1), plus ``offset`` (the pool as the
        second segment of an attention row table, after ``offset`` window rows): what attention reads in place.
        ``ids`` = K: entries 0 .. K - 1; ``limit`` [rows]: entries at or past it are -1; ``prefix`` [rows, P]: put
        in front (the window's rows: the whole attention row table, [rows, P + K]). One kernel (``paged_rows``)."""
        tables, rpb, offset, prefix = self.pool_row_map(key, offset, prefix)
        return paged_rows(ids, tables, rpb, offset, limit=limit, prefix=prefix)

    def pool_row_map(
        self, key: object, offset: int = 0, prefix: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int, int, torch.Tensor | None]:
        """``pool_rows``' arguments as an op that makes the row table itself takes them (``indexer_topk``'s
        ``row_map``): (block tables [rows, width] int64, store ``key``'s rows per block, ``offset``, ``prefix``
        [rows, P] int64 or None)."""
        return self["tables"], self.kv[key].rows_per_block, offset, prefix

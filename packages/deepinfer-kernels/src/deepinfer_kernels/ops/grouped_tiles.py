"""What the grouped expert GEMM ops share (``grouped_gemm``, ``mxfp4_grouped_gemm``): the contiguous kernels' tile
list built on the device from the expert offsets, so that no launch waits for the host, and the checks of the two
row layouts' arguments.

A tile is BLOCK_M consecutive rows of one expert, starting at the expert's first row: the rows of expert e
are split at off[e], off[e] + BLOCK_M, ... whatever the other experts own, so a row's tile position depends
on its expert's offset only. A list can leave each expert's last, partial tile to a second list of narrower
tiles (``TileSpec.tail`` / ``tail_of``, ``tail_split``): a kernel whose tile costs about the same however few of
its rows are filled (the weights are unpacked once a tile) then pays a narrow tile for an expert's few rows past
its last full one.

``expert_tile_schedule`` builds the list in one Triton launch (imported by the Triton backends only), and
``expert_tile_schedules`` up to four lists with different tilings and row bounds in one launch;
``expert_tile_schedule_ref`` is the same integer arithmetic in torch (about twenty small kernels, which cost a
decode step at batch 64 more than a tenth of its MoE time), the definition its tests compare with, bitwise."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options


class TileSpec(NamedTuple):
    """One tile list: tiles of ``block_m`` rows for the experts with min_rows <= rows <= max_rows (None: no bound).

    ``tail`` > 0 (a body list): an expert with at least one full tile and 1 .. ``tail`` rows past its last full
    tile gets no tile for those rows. ``tail_of`` > 0 (a tail list): one tile per such expert of a body list of
    ``tail_of``-row tiles, holding exactly those rows (so ``block_m`` >= their count: ``tail_split`` makes the
    pair)."""

    block_m: int
    min_rows: int = 0
    max_rows: int | None = None
    tail: int = 0
    tail_of: int = 0


def tail_split(body: TileSpec, tail_rows: int) -> tuple[TileSpec, TileSpec]:
    """(body, tail): ``body`` leaving each expert's last 1 .. ``tail_rows`` rows past a full tile to a list of
    ``tail_rows``-row tiles with the same row bounds; together they cover the rows ``body`` covers, once each."""
    if not 0 < tail_rows < body.block_m:
        raise ValueError(f"tail_split: tail_rows must be in (0, {body.block_m}), got {tail_rows}")
    return (body._replace(tail=tail_rows, tail_of=0),
            TileSpec(tail_rows, body.min_rows, body.max_rows, tail=0, tail_of=body.block_m))  # fmt: skip


def _slots(rows: int, n_exp: int, spec: TileSpec) -> int:
    """An upper bound on the tiles, from shapes only: ceil(R / BLOCK_M) plus one per expert that can have tiles
    (at most E, at most R // max(min_rows, 1): each has that many rows), and with max_rows at most
    ceil(max_rows / BLOCK_M) tiles per such expert (a prefill's 8-row-tile launch has E slots, not R / 8: the
    programs of empty slots cost launch time); a tail list one per expert of more than ``tail_of`` rows."""
    block_m, min_rows, max_rows = spec.block_m, spec.min_rows, spec.max_rows
    experts = min(n_exp, rows // max(min_rows, spec.tail_of + 1, 1))
    if spec.tail_of:
        return experts
    bound = -(-rows // block_m) + experts
    if max_rows is not None:
        bound = min(bound, experts * -(-max_rows // block_m))
    return bound


def _tile_counts(cnt, spec: TileSpec):
    """(tiles, first row offset) per expert of ``rows`` counts ``cnt`` (int64): the arithmetic the kernel repeats."""
    keep = cnt >= spec.min_rows
    if spec.max_rows is not None:
        keep &= cnt <= spec.max_rows
    tile = spec.tail_of or spec.block_m  # the body list's tiles, whose last partial one may go to the tail list
    full = torch.div(cnt, tile, rounding_mode="floor")
    rest = cnt - full * tile
    split = (full > 0) & (rest > 0) & (rest <= (spec.block_m if spec.tail_of else spec.tail))
    if spec.tail_of:
        return torch.where(keep & split, 1, 0), full * tile
    tiles = torch.div(cnt + spec.block_m - 1, spec.block_m, rounding_mode="floor") - split.long()
    return torch.where(keep, tiles, 0), torch.zeros_like(cnt)


def expert_tile_schedule_ref(
    expert_offsets: torch.Tensor,
    rows: int,
    block_m: int,
    min_rows: int = 0,
    max_rows: int | None = None,
    *,
    tail: int = 0,
    tail_of: int = 0,
):
    """Device-side tile list for R = ``rows`` sorted rows: for tile slot i, (expert or -1, first row, end row),
    as int32 tensors, and the slot count (``_slots``: slots past the last tile hold expert -1 and their programs
    return at once). Only experts with min_rows <= rows <= max_rows (None: no bound) get tiles, so two kernels
    can split the experts by their row counts (each row in exactly one of two lists with complementary bounds);
    ``tail`` / ``tail_of``: ``TileSpec``. A tile's rows are [first, min(first + BLOCK_M, end))."""
    spec = TileSpec(block_m, min_rows, max_rows, tail, tail_of)
    off = expert_offsets.to(torch.int64)
    n_exp = off.shape[0] - 1
    tiles, skip = _tile_counts(off[1:] - off[:-1], spec)
    cum = torch.cumsum(tiles, 0)
    slots = _slots(rows, n_exp, spec)
    i = torch.arange(slots, device=off.device)
    e = torch.searchsorted(cum, i, right=True)  # first expert whose tiles end after slot i
    valid = e < n_exp
    ec = e.clamp(max=n_exp - 1)
    r0 = off[ec] + skip[ec] + (i - (cum[ec] - tiles[ec])) * block_m
    tile_e = torch.where(valid, ec, -1).to(torch.int32)
    return tile_e, r0.to(torch.int32), off[ec + 1].to(torch.int32), slots


@triton.jit
def _spec(i, v):
    """Entry i (0 .. 3) of a 4-tuple of scalars."""
    return tl.where(i == 0, v[0], tl.where(i == 1, v[1], tl.where(i == 2, v[2], v[3])))


@triton.jit
def _own_tiles(cnt, BLOCK_M, MIN_ROWS, MAX_ROWS, TAIL, TAIL_OF):
    """(tiles, first row offset) of experts of ``cnt`` rows in one list: ``_tile_counts``."""
    keep = (cnt >= MIN_ROWS) & (cnt <= MAX_ROWS)
    tile = tl.where(TAIL_OF > 0, TAIL_OF, BLOCK_M)
    full = cnt // tile  # counts >= 0: truncation is the floor
    rest = cnt - full * tile
    split = (full > 0) & (rest > 0) & (rest <= tl.where(TAIL_OF > 0, BLOCK_M, TAIL))
    body = (cnt + BLOCK_M - 1) // BLOCK_M - split.to(cnt.dtype)
    tiles = tl.where(keep, tl.where(TAIL_OF > 0, split.to(cnt.dtype), body), 0)
    return tiles, tl.where(TAIL_OF > 0, full * tile, 0)


@triton.jit
def _tile_schedule_kernel(
    off_ptr, cum_ptr, tile_ptr, E, BM, MIN, MAX, SLOTS, BASE, TAIL, TAIL_OF, TOTAL,
    EP: tl.constexpr, SB: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # program l builds tile list l (up to four lists of the same offsets, each with its BLOCK_M, row bounds and
    # tail split; the arguments but E and TOTAL are 4-tuples): the tiles per expert and their running sum (kept
    # in cum_ptr for the gathers below), then per slot a binary search for the first expert whose tiles end
    # after it (searchsorted(cum, i, right=True)); tile_ptr holds [3, TOTAL] int32 (expert, first row, end
    # row), list l's slots from BASE_l
    lst = tl.program_id(0)
    BLOCK_M = _spec(lst, BM)
    MIN_ROWS = _spec(lst, MIN)
    MAX_ROWS = _spec(lst, MAX)
    N_SLOTS = _spec(lst, SLOTS)
    base = _spec(lst, BASE)
    TAIL_L = _spec(lst, TAIL)
    TAIL_OF_L = _spec(lst, TAIL_OF)
    cum_ptr += lst * E
    e = tl.arange(0, EP)
    e_ok = e < E
    lo = tl.load(off_ptr + e, mask=e_ok, other=0).to(tl.int64)
    hi = tl.load(off_ptr + e + 1, mask=e_ok, other=0).to(tl.int64)
    tiles = _own_tiles(hi - lo, BLOCK_M, MIN_ROWS, MAX_ROWS, TAIL_L, TAIL_OF_L)[0]
    tl.store(cum_ptr + e, tl.cumsum(tiles, 0), mask=e_ok)
    tl.debug_barrier()  # the running sums are in memory before any thread gathers them
    for s0 in range(0, N_SLOTS, SB):
        i = s0 + tl.arange(0, SB).to(tl.int64)
        a = tl.zeros([SB], dtype=tl.int32)
        b = tl.zeros([SB], dtype=tl.int32) + E
        for _ in tl.static_range(STEPS):
            live = a < b
            mid = (a + b) // 2
            c = tl.load(cum_ptr + mid, mask=live, other=0)
            right = c <= i
            a = tl.where(live & right, mid + 1, a)
            b = tl.where(live & ~right, mid, b)
        ec = tl.minimum(a, E - 1)
        first = tl.load(off_ptr + ec).to(tl.int64)
        end = tl.load(off_ptr + ec + 1).to(tl.int64)
        own, skip = _own_tiles(end - first, BLOCK_M, MIN_ROWS, MAX_ROWS, TAIL_L, TAIL_OF_L)  # as the reference's
        r0 = first + skip + (i - (tl.load(cum_ptr + ec) - own)) * BLOCK_M
        ok = i < N_SLOTS
        out = tile_ptr + base + i
        tl.store(out, tl.where(a < E, ec, -1), mask=ok)
        tl.store(out + TOTAL, r0.to(tl.int32), mask=ok)
        tl.store(out + 2 * TOTAL, end.to(tl.int32), mask=ok)


def expert_tile_schedules(expert_offsets: torch.Tensor, rows: int, specs: list[TileSpec | tuple]):
    """``expert_tile_schedule_ref`` for up to four ``TileSpec``s (or (block_m, min_rows, max_rows) tuples) of the
    same offsets, in one launch (a program a list): a list of (tile_e, tile_r0, tile_r1, slots), bitwise the
    reference's. A GEMM that splits its experts between kernels by row count builds all their lists at once (a
    decode step at batch 256 ran 48 schedule launches)."""
    if not 1 <= len(specs) <= 4:
        raise ValueError(f"expert_tile_schedules: 1 to 4 specs, got {len(specs)}")
    specs = [TileSpec(*s) for s in specs]
    n_exp = expert_offsets.shape[0] - 1
    dev = expert_offsets.device
    slots = [_slots(rows, n_exp, s) for s in specs]
    bases = [sum(slots[:i]) for i in range(len(specs))]
    total = sum(slots)
    tiles = torch.empty(3, total, dtype=torch.int32, device=dev)
    cum = torch.empty(len(specs), n_exp, dtype=torch.int64, device=dev)
    pad = 4 - len(specs)  # the kernel takes four; programs past len(specs) are not launched

    def field(values):
        values = tuple(values)
        return values + values[-1:] * pad

    _tile_schedule_kernel[(len(specs),)](
        expert_offsets.contiguous(), cum, tiles, n_exp, field(s.block_m for s in specs),
        field(s.min_rows for s in specs), field(rows if s.max_rows is None else s.max_rows for s in specs),
        field(slots), field(bases), field(s.tail for s in specs), field(s.tail_of for s in specs), total,
        EP=triton.next_power_of_2(n_exp), SB=256, STEPS=max(1, n_exp.bit_length()), num_warps=4,
        **pdl_options(dev),
    )  # fmt: skip
    return [(tiles[0, b : b + n], tiles[1, b : b + n], tiles[2, b : b + n], n) for b, n in zip(bases, slots)]


def expert_tile_schedule(
    expert_offsets: torch.Tensor,
    rows: int,
    block_m: int,
    min_rows: int = 0,
    max_rows: int | None = None,
    *,
    tail: int = 0,
    tail_of: int = 0,
):
    """``expert_tile_schedule_ref`` in one launch (same values, bitwise)."""
    return expert_tile_schedules(expert_offsets, rows, [TileSpec(block_m, min_rows, max_rows, tail, tail_of)])[0]


def check_row_vector(op: str, t: torch.Tensor | None, name: str, rows: int, integer: bool) -> None:
    """``t`` (if given) must be a 1-D integer (or floating-point) tensor of ``rows`` entries; ValueError naming it."""
    if t is None:
        return
    if t.dim() != 1 or t.shape[0] != rows or t.is_floating_point() == integer:
        kind = "integer" if integer else "floating point"
        raise ValueError(f"{op}: {name} must be {kind} [{rows}], got {t.dtype}{tuple(t.shape)}")


def check_contiguous_rows(
    op: str, expert_offsets: torch.Tensor, num_experts: int, row_scale: torch.Tensor | None, rows: int
) -> None:
    """Contiguous layout: ``expert_offsets`` integer [E + 1]; ``row_scale`` (if given) floating point [rows]."""
    if expert_offsets.dim() != 1 or expert_offsets.shape[0] != num_experts + 1 or expert_offsets.is_floating_point():
        raise ValueError(f"{op}: expert_offsets must be integer [{num_experts + 1}], got {tuple(expert_offsets.shape)}")
    check_row_vector(op, row_scale, "row_scale", rows, integer=False)


def check_gather_rows(
    op: str,
    row_expert: torch.Tensor,
    row_index: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    input_rows: int,
) -> None:
    """Gathered layout: ``row_expert`` integer [P]; ``row_index`` integer [P] (None: P must be ``input_rows``);
    ``row_scale`` (if given) floating point [P]."""
    p = row_expert.shape[0] if row_expert.dim() == 1 else -1
    check_row_vector(op, row_expert, "row_expert", p, integer=True)
    check_row_vector(op, row_index, "row_index", p, integer=True)
    if row_index is None and p != input_rows:
        raise ValueError(f"{op}: without row_index, row_expert must have one entry per row of x ({input_rows})")
    check_row_vector(op, row_scale, "row_scale", p, integer=False)

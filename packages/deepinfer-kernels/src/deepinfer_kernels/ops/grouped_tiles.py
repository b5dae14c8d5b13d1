"""What the grouped expert GEMM ops share (``grouped_gemm``, ``mxfp4_grouped_gemm``): the contiguous kernels' tile
list built on the device from the expert offsets, so that no launch waits for the host, and the checks of the two
row layouts' arguments.

A tile is BLOCK_M consecutive rows of one expert, starting at the expert's first row: the rows of expert e
are split at off[e], off[e] + BLOCK_M, ... whatever the other experts own, so a row's tile position depends
on its expert's offset only.

``expert_tile_schedule`` builds the list in one Triton launch (imported by the Triton backends only), and
``expert_tile_schedules`` up to three lists with different tilings and row bounds in one launch;
``expert_tile_schedule_ref`` is the same integer arithmetic in torch (about twenty small kernels, which cost a
decode step at batch 64 more than a tenth of its MoE time), the definition its tests compare with, bitwise."""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options


def _slots(rows: int, block_m: int, n_exp: int, min_rows: int, max_rows: int | None = None) -> int:
    """An upper bound on the tiles, from shapes only: ceil(R / BLOCK_M) plus one per expert that can have tiles
    (at most E, at most R // max(min_rows, 1): each has that many rows), and with max_rows at most
    ceil(max_rows / BLOCK_M) tiles per such expert (a prefill's 8-row-tile launch has E slots, not R / 8: the
    programs of empty slots cost launch time)."""
    experts = min(n_exp, rows // max(min_rows, 1))
    bound = -(-rows // block_m) + experts
    if max_rows is not None:
        bound = min(bound, experts * -(-max_rows // block_m))
    return bound


def expert_tile_schedule_ref(
    expert_offsets: torch.Tensor, rows: int, block_m: int, min_rows: int = 0, max_rows: int | None = None
):
    """Device-side tile list for R = ``rows`` sorted rows: for tile slot i, (expert or -1, first row, end row),
    as int32 tensors, and the slot count (``_slots``: slots past the last tile hold expert -1 and their programs
    return at once). Only experts with min_rows <= rows <= max_rows (None: no bound) get tiles, so two kernels
    can split the experts by their row counts (each row in exactly one of two lists with complementary bounds)."""
    off = expert_offsets.to(torch.int64)
    n_exp = off.shape[0] - 1
    cnt = off[1:] - off[:-1]
    keep = (cnt >= min_rows) & (cnt <= (max_rows if max_rows is not None else rows))
    tiles = torch.where(keep, torch.div(cnt + block_m - 1, block_m, rounding_mode="floor"), 0)
    cum = torch.cumsum(tiles, 0)
    slots = _slots(rows, block_m, n_exp, min_rows, max_rows)
    i = torch.arange(slots, device=off.device)
    e = torch.searchsorted(cum, i, right=True)  # first expert whose tiles end after slot i
    valid = e < n_exp
    ec = e.clamp(max=n_exp - 1)
    r0 = off[ec] + (i - (cum[ec] - tiles[ec])) * block_m
    tile_e = torch.where(valid, ec, -1).to(torch.int32)
    return tile_e, r0.to(torch.int32), off[ec + 1].to(torch.int32), slots


@triton.jit
def _spec(i, v0, v1, v2):
    """The value of tile list i (0, 1 or 2) among three scalars."""
    return tl.where(i == 0, v0, tl.where(i == 1, v1, v2))


@triton.jit
def _tile_schedule_kernel(
    off_ptr, cum_ptr, tile_ptr, E,
    BM0, MIN0, MAX0, SLOTS0, BASE0, BM1, MIN1, MAX1, SLOTS1, BASE1, BM2, MIN2, MAX2, SLOTS2, BASE2, TOTAL,
    EP: tl.constexpr, SB: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    # program l builds tile list l (up to three lists of the same offsets, each with its BLOCK_M and row bounds):
    # the tiles per expert and their running sum (kept in cum_ptr for the gathers below), then per slot a binary
    # search for the first expert whose tiles end after it (searchsorted(cum, i, right=True)); tile_ptr holds
    # [3, TOTAL] int32 (expert, first row, end row), list l's slots from BASE_l
    lst = tl.program_id(0)
    BLOCK_M = _spec(lst, BM0, BM1, BM2)
    MIN_ROWS = _spec(lst, MIN0, MIN1, MIN2)
    MAX_ROWS = _spec(lst, MAX0, MAX1, MAX2)
    SLOTS = _spec(lst, SLOTS0, SLOTS1, SLOTS2)
    base = _spec(lst, BASE0, BASE1, BASE2)
    cum_ptr += lst * E
    e = tl.arange(0, EP)
    e_ok = e < E
    lo = tl.load(off_ptr + e, mask=e_ok, other=0).to(tl.int64)
    hi = tl.load(off_ptr + e + 1, mask=e_ok, other=0).to(tl.int64)
    cnt = hi - lo
    keep = (cnt >= MIN_ROWS) & (cnt <= MAX_ROWS)
    tiles = tl.where(keep, (cnt + BLOCK_M - 1) // BLOCK_M, 0)  # counts >= 0: truncation is the floor
    tl.store(cum_ptr + e, tl.cumsum(tiles, 0), mask=e_ok)
    tl.debug_barrier()  # the running sums are in memory before any thread gathers them
    for s0 in range(0, SLOTS, SB):
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
        n = end - first
        own = tl.where((n >= MIN_ROWS) & (n <= MAX_ROWS), (n + BLOCK_M - 1) // BLOCK_M, 0)  # as the reference's
        r0 = first + (i - (tl.load(cum_ptr + ec) - own)) * BLOCK_M
        ok = i < SLOTS
        out = tile_ptr + base + i
        tl.store(out, tl.where(a < E, ec, -1), mask=ok)
        tl.store(out + TOTAL, r0.to(tl.int32), mask=ok)
        tl.store(out + 2 * TOTAL, end.to(tl.int32), mask=ok)


TileSpec = tuple[int, int, int | None]  # (BLOCK_M, min_rows, max_rows or None)


def expert_tile_schedules(expert_offsets: torch.Tensor, rows: int, specs: list[TileSpec]):
    """``expert_tile_schedule_ref`` for up to three (block_m, min_rows, max_rows) specs of the same offsets, in one
    launch (a program a list): a list of (tile_e, tile_r0, tile_r1, slots), bitwise the reference's. A GEMM that
    splits its experts between kernels by row count builds all their lists at once (a decode step at batch 256 ran
    48 schedule launches)."""
    if not 1 <= len(specs) <= 3:
        raise ValueError(f"expert_tile_schedules: 1 to 3 specs, got {len(specs)}")
    n_exp = expert_offsets.shape[0] - 1
    dev = expert_offsets.device
    slots = [_slots(rows, bm, n_exp, lo, hi) for bm, lo, hi in specs]
    bases = [sum(slots[:i]) for i in range(len(specs))]
    total = sum(slots)
    tiles = torch.empty(3, total, dtype=torch.int32, device=dev)
    cum = torch.empty(len(specs), n_exp, dtype=torch.int64, device=dev)
    lists = [(bm, lo, rows if hi is None else hi, n, b) for (bm, lo, hi), n, b in zip(specs, slots, bases)]
    lists += [lists[-1]] * (3 - len(lists))  # the kernel takes three; programs past len(specs) are not launched
    _tile_schedule_kernel[(len(specs),)](
        expert_offsets.contiguous(), cum, tiles, n_exp, *(v for spec in lists for v in spec), total,
        EP=triton.next_power_of_2(n_exp), SB=256, STEPS=max(1, n_exp.bit_length()), num_warps=4,
        **pdl_options(dev),
    )  # fmt: skip
    return [(tiles[0, b : b + n], tiles[1, b : b + n], tiles[2, b : b + n], n) for b, n in zip(bases, slots)]


def expert_tile_schedule(
    expert_offsets: torch.Tensor, rows: int, block_m: int, min_rows: int = 0, max_rows: int | None = None
):
    """``expert_tile_schedule_ref`` in one launch (same values, bitwise)."""
    return expert_tile_schedules(expert_offsets, rows, [(block_m, min_rows, max_rows)])[0]


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

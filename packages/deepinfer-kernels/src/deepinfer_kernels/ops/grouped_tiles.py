"""What the grouped expert GEMM ops share (``grouped_gemm``, ``mxfp4_grouped_gemm``): the contiguous kernels' tile
list built on the device from the expert offsets, so that no launch waits for the host, and the checks of the two
row layouts' arguments.

A tile is BLOCK_M consecutive rows of one expert, starting at the expert's first row: the rows of expert e
are split at off[e], off[e] + BLOCK_M, ... whatever the other experts own, so a row's tile position depends
on its expert's offset only."""

import torch


def expert_tile_schedule(expert_offsets: torch.Tensor, rows: int, block_m: int):
    """Device-side tile list for R = ``rows`` sorted rows: for tile slot i, (expert or -1, first row, end row),
    as int32 tensors, and the slot count ceil(R / BLOCK_M) + E (an upper bound on the tiles, from shapes
    only: slots past the last tile hold expert -1 and their programs return at once)."""
    off = expert_offsets.to(torch.int64)
    n_exp = off.shape[0] - 1
    tiles = torch.div(off[1:] - off[:-1] + block_m - 1, block_m, rounding_mode="floor")
    cum = torch.cumsum(tiles, 0)
    slots = -(-rows // block_m) + n_exp
    i = torch.arange(slots, device=off.device)
    e = torch.searchsorted(cum, i, right=True)  # first expert whose tiles end after slot i
    valid = e < n_exp
    ec = e.clamp(max=n_exp - 1)
    r0 = off[ec] + (i - (cum[ec] - tiles[ec])) * block_m
    tile_e = torch.where(valid, ec, -1).to(torch.int32)
    return tile_e, r0.to(torch.int32), off[ec + 1].to(torch.int32), slots


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

"""What the split-K GEMM kernels share (``fp8_gemm``, ``linear``, ``grouped_linear``): the SM count their K splits
are sized for, the fp32 workspace of the partial products and their fixed-order sum (part of what keeps them
batch-invariant).

With SUM_IN_KERNEL the sum runs in the GEMM's own launch (``store_split_tile``): each program of a split output
tile stores its fp32 part, and the last of them to arrive (an acq_rel counter of ``counter_block``) adds the parts
in split order and stores the tile, as ``linear``'s skinny kernel does. A decode step runs ~40 split GEMMs; a second
launch for each sum cost ~2 us of serial time apiece (session 37's batch-1 profile: 41 ``split_sum_kernel``
launches, 76 us). Calls of more tiles than there are counters keep the second launch (``sum_splits``); the bits are
the same either way: the same parts added in the same order. Without it (and above SUM_IN_KERNEL_MAX_ROWS rows),
the second launch adds them."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import COUNTERS, counter_block, pdl_options

SMS = 132  # H200; only sets how far decode-size GEMMs are split along K
# Whether split GEMMs of at most SUM_IN_KERNEL_MAX_ROWS output rows add their parts in their own launch (else the
# second launch; the bits are the same). H100, V4.1 slice (``--quant fp8+fp4``, 4K, pipelined, same lease, three
# rounds in two A/Bs; ``ab_split_sum_shared_fp8_gemv_h100_session38.log``), every split GEMM summing in-kernel
# against none: batch 1 -52 / -47 us, batch 8 +63 / +49 us, 64 and 256 within noise. At 8 rows the last program
# of a tile reads its SPLIT parts alone (16 x 2 KB for a 64-column tile), after an arrival; the second launch reads
# them with every SM. Cold GEMVs back-to-back in a graph moved within noise either way (``gemv`` table there).
SUM_IN_KERNEL = True
SUM_IN_KERNEL_MAX_ROWS = 1


@triton.jit
def split_sum_kernel(ws_ptr, c_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """c = ws[0] + ws[1] + ... + ws[SPLIT-1], added in that order (fixed: batch-invariant), then cast."""
    pdl_prologue(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


@triton.jit
def store_split_tile(acc, c_ptr, ws_ptr, cnt_ptr, pid_k, offs, mask, MN,
                     SPLIT: tl.constexpr, IN_KERNEL: tl.constexpr):  # fmt: skip
    """A program's fp32 tile ``acc`` of output c (``offs``: its int64 offsets in c; MN = c.numel(), int64 so that
    the parts' offsets do not wrap): stored cast when SPLIT == 1; else stored as part ``pid_k`` of the fp32 workspace
    [SPLIT, *c.shape], and with IN_KERNEL the last of the tile's SPLIT programs to arrive at ``cnt_ptr`` (its tile's
    counter) adds the parts in split order (as ``split_sum_kernel``: the same bits), stores c and leaves the counter
    at zero. Works from Gluon kernels."""
    if SPLIT == 1:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * MN + offs, acc, mask=mask)
        if IN_KERNEL:
            tl.debug_barrier()  # every thread's part is written before the one release below
            if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    total += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def k_split(tiles: int, steps: int, *, programs_per_sm: int, min_steps: int, max_split: int) -> int:
    """The K split (a power of two) of a GEMM of ``tiles`` output tiles and ``steps`` K steps: doubled while the
    programs stay within ~``programs_per_sm`` an SM, each split keeps at least ``min_steps`` steps, and at most
    ``max_split``. From the shape only (never M), so a batch-invariant kernel stays so."""
    split = 1
    while split < max_split and tiles * split * 2 <= programs_per_sm * SMS and steps // (split * 2) >= min_steps:
        split *= 2
    return split


@dataclass(frozen=True)
class SplitOutput:
    """Where a GEMM split ``split`` ways along K writes (``split_output``): ``ws`` (``c`` itself when unsplit, else
    an fp32 [split, *c.shape] workspace), ``counters`` (a tile's arrival counter at its index, with ``in_kernel``)
    and whether the kernel adds the parts itself (``store_split_tile``'s IN_KERNEL)."""

    c: torch.Tensor
    ws: torch.Tensor
    counters: torch.Tensor
    split: int
    in_kernel: bool

    def finish(self) -> torch.Tensor:
        """After the launch: the second launch's sum when the kernel did not add the parts; returns c."""
        if self.split > 1 and not self.in_kernel:
            sum_splits(self.ws, self.c, self.split)
        return self.c


def split_output(c: torch.Tensor, split: int, tiles: int) -> SplitOutput:
    """The outputs of a launch of ``tiles`` output tiles (programs of one K split; their counters are indices
    0 .. tiles - 1) split ``split`` ways: parts added in the kernel with SUM_IN_KERNEL when c has at most
    SUM_IN_KERNEL_MAX_ROWS rows (its leading dimension) and the tiles fit COUNTERS."""
    if split == 1:
        return SplitOutput(c, c, c, 1, False)
    ws = split_workspace(c, split)
    in_kernel = SUM_IN_KERNEL and c.shape[0] <= SUM_IN_KERNEL_MAX_ROWS and tiles <= COUNTERS
    return SplitOutput(c, ws, counter_block(c.device) if in_kernel else ws, split, in_kernel)


def split_workspace(c: torch.Tensor, split: int) -> torch.Tensor:
    """Where a GEMM split ``split`` ways along K writes: ``c`` itself when unsplit, else an fp32 [split, *c.shape]
    workspace for ``sum_splits``."""
    return c if split == 1 else torch.empty(split, *c.shape, dtype=torch.float32, device=c.device)


def sum_splits(ws: torch.Tensor, c: torch.Tensor, split: int) -> None:
    """c = the splits of ``ws`` added in order (``split_sum_kernel``); nothing when unsplit (``ws`` is ``c``)."""
    if split > 1:
        mn = c.numel()
        split_sum_kernel[(triton.cdiv(mn, 1024),)](
            ws, c, mn, SPLIT=split, BLOCK=1024, num_warps=4, **pdl_options(ws.device)
        )

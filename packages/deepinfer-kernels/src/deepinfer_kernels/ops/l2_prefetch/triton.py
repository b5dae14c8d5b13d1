"""Triton ``l2_prefetch`` (CUDA backend ``triton``, sm_90 and later): bulk L2 prefetches, one per (span, piece).

The bytes to bring in are items of at most CHUNK bytes: with ``period`` = 0 the first ``take`` bytes of the tensor
in consecutive pieces; otherwise the leading ``take`` bytes of every ``period``-byte span, each span cut into pieces
the same way. Each item is one ``cp.async.bulk.prefetch.L2.global`` (16-byte aligned address, a multiple of 16
bytes: an item's ends are rounded inwards), issued by one thread; the instruction returns at once and the copy
engine fetches the lines, so the kernel ends long before the bytes arrive and needs no result or wait. A few dozen
programs issue a few thousand items; nothing orders them against later kernels (a hint: a line fetched late, or
evicted before its use, is read from HBM as without it).
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._triton_launch import sm90_or_newer, triton_cuda_available
from deepinfer_kernels.registry import register_backend

CHUNK = 16384  # bytes per bulk prefetch
ITEMS = 64  # bulk prefetches per program (two warps: one per thread)
EVICT_LAST = False  # prefetch with an L2::evict_last cache policy instead of the default (evict_normal)

_ASM_NORMAL = tl.constexpr("""{
 .reg .pred p;
 setp.ne.u32 p, $2, 0;
 @p cp.async.bulk.prefetch.L2.global [$1], $2;
 mov.u32 $0, 0;
}""")
_ASM_EVICT_LAST = tl.constexpr("""{
 .reg .pred p;
 .reg .b64 pol;
 setp.ne.u32 p, $2, 0;
 createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
 @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
 mov.u32 $0, 0;
}""")


@triton.jit
def _l2_prefetch_kernel(
    base, nbytes, period, take, pieces, n_items, rec_ptr, CHUNK: tl.constexpr, ITEMS: tl.constexpr,
    EVICT_LAST: tl.constexpr, RECORD: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * ITEMS + tl.arange(0, ITEMS)
    i = tl.minimum(i, n_items - 1)  # the tail repeats the last item: the same bytes twice is harmless
    span = i // pieces
    start = base + span * period + (i - span * pieces) * CHUNK
    end = tl.minimum(tl.minimum(base + span * period + take, base + nbytes), start + CHUNK)
    lo = (start + 15) // 16 * 16
    size = tl.maximum(end // 16 * 16 - lo, 0).to(tl.int32)
    if RECORD:  # the items' ranges instead of the prefetches (tests, and the interpreter, which has no asm)
        j = tl.program_id(0).to(tl.int64) * ITEMS + tl.arange(0, ITEMS)
        tl.store(rec_ptr + 2 * j, lo - base, mask=j < n_items)
        tl.store(rec_ptr + 2 * j + 1, size.to(tl.int64), mask=j < n_items)
    elif EVICT_LAST:
        tl.inline_asm_elementwise(_ASM_EVICT_LAST, "=r,l,r", [lo, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_ASM_NORMAL, "=r,l,r", [lo, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_items(nbytes: int, max_bytes: int, period: int, chunk: int) -> tuple[int, int, int, int]:
    """(period, take, pieces, items) of a call on ``nbytes`` bytes: the leading ``take`` bytes of each ``period``-byte
    span (with ``period`` 0, or not below ``nbytes``: one span, the first ``max_bytes``), in ``pieces`` items of at
    most ``chunk`` bytes a span. A span takes the call's share ``max_bytes / nbytes`` of its bytes, rounded up."""
    share = min(max_bytes, nbytes)
    if period == 0 or period >= nbytes:
        period, take, spans = nbytes, share, 1
    else:
        take, spans = min(period, -(-share * period // nbytes)), -(-nbytes // period)
    pieces = -(-take // chunk)
    return period, take, pieces, spans * pieces


def l2_prefetch_triton(t: torch.Tensor, max_bytes: int, period: int) -> None:
    if not sm90_or_newer(t.device):
        return  # bulk prefetch is sm_90's; elsewhere the hint is dropped, as the reference does
    _launch(t, max_bytes, period, None)


def prefetch_ranges(t: torch.Tensor, max_bytes: int, period: int) -> torch.Tensor:
    """The byte ranges a call would prefetch, as the kernel computes them: int64 [items, 2] of (offset from
    ``t.data_ptr()``, size; size 0: nothing). For tests; CPU tensors under the interpreter."""
    nbytes = t.numel() * t.element_size()
    n_items = prefetch_items(nbytes, max_bytes, period, CHUNK)[3]
    rec = torch.full((max(n_items, 1), 2), -1, dtype=torch.int64, device=t.device)
    _launch(t, max_bytes, period, rec)
    return rec[:n_items]


def _launch(t: torch.Tensor, max_bytes: int, period: int, rec: torch.Tensor | None) -> None:
    nbytes = t.numel() * t.element_size()
    period, take, pieces, n_items = prefetch_items(nbytes, max_bytes, period, CHUNK)
    if n_items == 0:
        return
    _l2_prefetch_kernel[(triton.cdiv(n_items, ITEMS),)](
        t.data_ptr(), nbytes, period, take, pieces, n_items, rec, CHUNK=CHUNK, ITEMS=ITEMS, EVICT_LAST=EVICT_LAST,
        RECORD=rec is not None, num_warps=max(1, ITEMS // 32),
    )  # fmt: skip


register_backend(
    "l2_prefetch", "triton", l2_prefetch_triton, devices=("cuda",), priority=10, available=triton_cuda_available,
    batch_invariant=True,
)  # fmt: skip

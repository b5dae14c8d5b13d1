"""Triton radix-select top-k (CUDA backend ``triton``), in the spirit of DeepSelect.

One program per row; the row is streamed from global memory in BLOCK chunks:

1. Every score maps to a 32-bit key whose signed-int order is the float order (negative floats get
   their 31 low bits flipped; -0.0 becomes +0.0). Non-selectable entries (NaN, -inf, n >= length)
   get INT32_MIN, below every real key.
2. Up to four histogram passes over 8-bit digits of the key (most significant first, in
   unsigned order, i.e. with the sign bit flipped) narrow down T, the key of the k-th largest entry,
   and how many entries of T's bucket are still needed (``k_rem``); a pass is skipped once the
   bucket holds exactly k_rem entries (then all of them are taken and T's low bits do not matter).
3. One compaction pass in index order writes every entry above T's bucket, plus the first ``k_rem``
   entries inside it (lower index wins: the contract's tie rule), at their running prefix count, so
   the output is ascending without a sort; then -1 fills the rest of the row.

So two to five reads of the row (after the first, mostly L2 hits for indexer-size rows). One program
per row is latency-bound at small batch (each tl.histogram pass costs ~90 us for a 128K row on H200, and
2048 bins cost ~4x 256 bins, so wider digits do not pay);
DeepSelect's single-read, cluster-split design is the next step. Results are exact (integer counts
only), hence bitwise equal to the reference and trivially batch-invariant.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

BLOCK = 2048  # elements per chunk of the row stream
NUM_WARPS = 8


@triton.jit
def _topk_select_kernel(
    s_ptr, len_ptr, out_ptr, N, K, s_stride, out_stride, HAS_LEN: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * s_stride
    dst = out_ptr + row * out_stride
    length = N
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), N).to(tl.int32)
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    int_min: tl.constexpr = -2147483648

    # Radix passes over 8-bit digits (most significant first) of the unsigned-order key u.
    # prefix: the decided high bits of T's u; level: how many low bits are still undecided. A pass
    # is skipped once the boundary bucket holds exactly the k_rem entries still needed (they are all
    # taken, so T's low bits never matter).
    prefix = tl.zeros([], dtype=tl.int32)
    k_rem = tl.zeros([], dtype=tl.int32)
    level = tl.full([], 32, dtype=tl.int32)
    go = tl.full([], 1, dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if go != 0:
            hist = tl.zeros([256], dtype=tl.int32)
            n_valid = tl.zeros([], dtype=tl.int32)
            for start in range(0, N, BLOCK):
                idx = start + offs
                x = tl.load(src + idx, mask=idx < N, other=0.0)
                bits = x.to(tl.int32, bitcast=True)
                bits = tl.where(bits == int_min, 0, bits)  # -0.0 -> +0.0
                key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order = float order
                valid = (idx < length) & (x == x) & (x != float("-inf"))
                key = tl.where(valid, key, int_min)
                u = key ^ int_min  # unsigned order as a bit pattern
                digit = (u >> shift) & 0xFF
                in_row = idx < N
                if p == 0:
                    n_valid += tl.sum(valid.to(tl.int32), axis=0)
                    match = in_row
                    hist += tl.histogram(digit, 256, mask=match)
                else:
                    match = in_row & (((u ^ prefix) >> (shift + 8)) == 0)
                    if tl.sum(match.to(tl.int32), axis=0) > 0:  # later passes: most chunks miss the bucket
                        hist += tl.histogram(digit, 256, mask=match)
            if p == 0:
                k_rem = tl.minimum(K, n_valid)
            # the digit of T: the largest d with #(digit >= d) >= k_rem
            cnt_ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            d = tl.max(tl.where(cnt_ge >= k_rem, bins, -1), axis=0)
            k_rem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
            prefix = prefix | (d << shift)
            level = level * 0 + shift
            go = (k_rem < tl.sum(tl.where(bins == d, hist, 0), axis=0)).to(tl.int32)

    # compaction in index order: key above T's decided bits, or equal to them among the first k_rem
    t_hi = (prefix ^ int_min) >> level
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        x = tl.load(src + idx, mask=idx < N, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == int_min, 0, bits)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        valid = (idx < length) & (x == x) & (x != float("-inf"))
        hi = key >> level  # arithmetic shift: monotone in the signed key
        eq = (valid & (hi == t_hi)).to(tl.int32)
        eq_rank = n_eq + tl.cumsum(eq, axis=0) - 1
        sel = (valid & (hi > t_hi)) | ((eq == 1) & (eq_rank < k_rem))
        sel_i = sel.to(tl.int32)
        pos = n_sel + tl.cumsum(sel_i, axis=0) - 1
        tl.store(dst + pos, idx.to(tl.int64), mask=sel)
        n_sel += tl.sum(sel_i, axis=0)
        n_eq += tl.sum(eq, axis=0)
    for start in range(0, K, BLOCK):
        idx = start + offs
        tl.store(dst + idx, tl.full([BLOCK], -1, tl.int64), mask=(idx >= n_sel) & (idx < K))


def topk_select_triton(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, *, block: int = BLOCK, num_warps: int = NUM_WARPS
) -> torch.Tensor:
    """The op (contract in ``__init__.py``); ``block`` / ``num_warps`` are exposed for the benchmark's sweep."""
    s, n = scores.shape
    width = min(k, n)
    out = torch.empty(s, width, dtype=torch.int64, device=scores.device)
    if s == 0:
        return out
    if width == 0:
        return out
    require_same_device(scores, *([lengths] if lengths is not None else []))
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    lens = lengths.contiguous() if lengths is not None else scores  # dummy pointer when absent
    _topk_select_kernel[(s,)](
        scores, lens, out, n, width, scores.stride(0), out.stride(0),
        HAS_LEN=lengths is not None, BLOCK=block, num_warps=num_warps, **pdl_options(scores.device),
    )  # fmt: skip
    return out


register_backend(
    "topk_select", "triton", topk_select_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

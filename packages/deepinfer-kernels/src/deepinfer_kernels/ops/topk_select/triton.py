"""Triton radix-select top-k (CUDA backend ``triton``), in the spirit of DeepSelect.

The steps, as one program per row runs them:

1. Every score maps to a 32-bit key whose signed-int order is the float order (negative floats get
   their 31 low bits flipped; -0.0 becomes +0.0). Non-selectable entries (NaN, -inf, n >= length,
   False in the optional mask) get INT32_MIN, below every real key.
2. Up to four histogram passes over 8-bit digits of the key (most significant first, in
   unsigned order, i.e. with the sign bit flipped) narrow down T, the key of the k-th largest entry,
   and how many entries of T's bucket are still needed (``k_rem``); a pass is skipped once the
   bucket holds exactly k_rem entries (then all of them are taken and T's low bits do not matter).
3. One compaction pass in index order writes every entry above T's bucket, plus the first ``k_rem``
   entries inside it (lower index wins: the contract's tie rule), at their running prefix count, so
   the output is ascending without a sort; then -1 fills the rest of the row.

Four kernels share these steps (``_keys``; ``_radix`` over ``_in_bucket``, ``_digit_hist``, ``_narrow``; ``_select``):

* ``_topk_select_grid_kernel``, rows of at least ``GRID_MIN`` entries at small batch (the decode indexer from 4K
  tokens on V4.1 and 32K on V4, at batch 1-8): the row is cut into 512-4096-entry pieces (``grid_plan``: the
  smallest whose programs fit the SMs), one program each, read once and held in registers, and the P programs run
  one selection: each pass adds their histograms in a zeroed workspace and waits at a barrier on the row's counter
  (``_grid_barrier``), then every program reads the row's histogram and takes the same decision; the compaction
  waits once more for the pieces' counts above / at T to place its entries. A pass costs a barrier (~1-2 us) where
  one program over the whole row pays its per-entry histogram work (~3 us per 1K entries for four passes): 8448
  entries in 8.4 us against 20 split, 33792 in 8.8 against 24.5. All pieces of a row must be resident at once, so
  the kernel never has more programs than SMs, and never runs under the interpreter (which runs programs one after
  another).
* ``_topk_select_block_kernel``, rows of at most ``BLOCK_ROW_MAX`` entries otherwise (the decode indexer: N =
  context / ratio, 1K-8K at 4K-32K tokens; under GRID_MIN, or at larger batches): the row is read once and every
  pass works on the keys in registers, held as a power of two plus a power-of-two tail where that is smaller
  (``register_parts``: the rows are as wide as the step's bucketed block tables, so often just past a power of
  two). At small batch the op is one program's latency, and each re-read of the row is a dependent L2 round trip.
* ``_topk_select_split_kernel``, longer rows while k is small against them and the grid kernel does not fit (the
  decode indexer at 32K tokens from about batch 16: 16K-32K entries, k = 512): the row is cut into CHUNK-entry
  pieces, one program each, read once. Each program selects its piece's top k in registers as above and writes the
  chosen (key, index) pairs in index order to a workspace; the last program of the row to finish (an arrival
  counter per row, as ``linear``'s split-K) selects the row's top k among the pieces' P * k candidates, again in
  registers. Exact: a piece that drops an entry equal to the row's k-th key already holds k entries at or above it,
  each ahead of it in the tie order, so the row's selection never needs it; and the candidates' order is the row's
  index order, so the lower index still wins ties and the output stays ascending.
* ``_topk_select_kernel``, longer rows otherwise: the row is streamed in ``BLOCK`` chunks, so two to five reads of
  it (after the first, mostly L2 hits for indexer-size rows). One program per row is latency-bound at small batch
  (each tl.histogram pass costs ~90 us for a 128K row on H200, and 2048 bins cost ~4x 256 bins, so wider digits
  do not pay).

With a row map (``HAS_MAP``; ``indexer_topk``'s ``row_map``, a decode step's attention row table), every kernel writes
each pick's pool row instead of its index, through its request's block table (``paged_rows``'s rule, int64), at
column n_pre + j of a row whose first n_pre columns it copies from the prefix (a request's window rows): the
``paged_rows`` launch that followed the top-k (~4.4 us on the index lane per CSA layer at batch 1, H200) is gone.
The one-program-per-row kernels copy the prefix in that program; the grid and split kernels, which cut a row into
pieces, in piece 0. Without it (a constexpr) the kernels are the same code as before.

Results are exact (integer counts only), hence bitwise equal to the reference and trivially batch-invariant.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import (
    COUNTERS,
    SCRATCH_WORDS,
    counter_block,
    interpreting,
    pdl_options,
    require_same_device,
    sm_count,
    triton_cuda_available,
    zeroed_scratch,
)
from deepinfer_kernels.registry import register_backend

BLOCK = 2048  # elements per chunk of the row stream
NUM_WARPS = 8
BLOCK_ROW_MAX = 8192  # rows up to this many entries are held in registers (``_topk_select_block_kernel``)
SPLIT_CHUNK = 4096  # entries per program of the split kernel (a row of 32K: 8 programs)
SPLIT_CAND_MAX = 8192  # the split kernel's candidates (pieces x k) per row, held in registers by the last program
# and at most this many programs (rows x pieces): past it the stream's one program per row is as fast or faster.
# H200, CUDA graphs, k = 512 (bench_topk_select.py --long): N = 32K at 1 / 8 / 64 / 256 rows 33 / 32 / 74 / 243 us
# split against 108 / 114 / 123 / 199 streamed; N = 16K at 64 / 256 rows 41 / 128 against 61 / 101. 576 = the nine
# pieces of a 33792-entry row (V4.1's index at 32K) x 64 rows: 78 us split against 128 streamed (session 21,
# --buckets; V4.1 batch 64 at 32K 10.75 -> 10.67 ms, twice); every measured count up to it splits as fast or faster
SPLIT_MAX_PROGRAMS = 576
# The grid kernel from GRID_MIN entries, in the smallest pieces of GRID_CHUNKS whose programs fit the SMs. H200,
# k = 512, CUDA graphs, us warm / cold, one row (bench_topk_select.py --grid, session 24): 5120 entries (V4.1 at
# 4K tokens) 15.8 / 16.1 with the register kernel -> 10.4 / 11.4 in 512-entry pieces; 8448 (V4 at 32K) 20.2 / 20.8
# split -> 8.4 / 9.0; 33792 (V4.1 at 32K) 24.5 / 24.5 -> 8.8 / 9.8; 8 rows of 8448: 26.5 -> 15.0 in 1024-entry pieces.
# 2048 entries stay in registers (9.2 us; 10.5 in four pieces).
GRID_MIN = 4096
GRID_CHUNKS = (512, 1024, 2048, 4096)
GRID_MIN_PIECES = 4
INT_MIN = tl.constexpr(-2147483648)
GRID_WS_WORDS = 4 * 256 + 1  # a grid-selected row's zeroed workspace: 4 passes' histograms, its selectable count
GRID_WS = tl.constexpr(GRID_WS_WORDS)
GRID_WS_POW2 = tl.constexpr(2048)
PREFIX_BLOCK = tl.constexpr(128)  # prefix columns a row-mapped program copies at a time (V4's window: 128, one step)


@triton.jit
def _keys(src, idx, N, length, msk, HAS_MASK: tl.constexpr):
    """(key, selectable) of row entries ``idx``: the signed-order int32 key of each score, INT_MIN where the entry
    is not selectable (NaN, -inf, at or past ``length``, False in the row's mask ``msk``) or past the row's end N."""
    x = tl.load(src + idx, mask=idx < N, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == INT_MIN, 0, bits)  # -0.0 -> +0.0
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order = float order
    valid = (idx < length) & (x == x) & (x != float("-inf"))
    if HAS_MASK:
        valid = valid & (tl.load(msk + idx, mask=idx < N, other=0) != 0)
    return tl.where(valid, key, INT_MIN), valid


@triton.jit
def _in_bucket(key, in_row, prefix, shift, first):
    """The entries a pass at digit ``shift`` counts: those whose unsigned-order key has the higher digits decided so
    far (``prefix``), every entry of the row in the first pass (``first``; its shift of 32 is out of range)."""
    return in_row & (first | ((((key ^ INT_MIN) ^ prefix) >> tl.minimum(shift + 8, 31)) == 0))


@triton.jit
def _digit_hist(key, match, shift):
    """Histogram (256 bins) of the 8-bit digit at ``shift`` of the unsigned-order keys at ``match``."""
    digit = ((key ^ INT_MIN) >> shift) & 0xFF  # key ^ INT_MIN: the unsigned order as a bit pattern
    return tl.histogram(digit, 256, mask=match)


@triton.jit
def _narrow(hist, k_rem, prefix, shift):
    """One radix step: T's digit d at ``shift`` is the largest with #(digit >= d) >= k_rem. Returns (k_rem less
    the entries above d, prefix with d, whether d's bucket holds more than k_rem entries: another pass)."""
    bins = tl.arange(0, 256)
    cnt_ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    d = tl.max(tl.where(cnt_ge >= k_rem, bins, -1), axis=0)
    k_rem -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
    go = (k_rem < tl.sum(tl.where(bins == d, hist, 0), axis=0)).to(tl.int32)
    return k_rem, prefix | (d << shift), go


@triton.jit
def _radix(key, in_row, key_t, in_tail, k_rem, TAIL: tl.constexpr):
    """The radix passes over keys held in registers (``in_row``: the entries that exist), as a power-of-two block
    plus, when TAIL > 0, a power-of-two tail (``key_t``, ``in_tail``; ignored otherwise): (k_rem, the decided high
    bits of T's unsigned-order key, how many low bits are still undecided)."""
    prefix = tl.zeros([], dtype=tl.int32)
    level = tl.full([], 32, dtype=tl.int32)
    go = tl.full([], 1, dtype=tl.int32)
    for p in range(4):
        if go != 0:
            shift = 24 - 8 * p
            hist = _digit_hist(key, _in_bucket(key, in_row, prefix, shift, p == 0), shift)
            if TAIL > 0:
                hist += _digit_hist(key_t, _in_bucket(key_t, in_tail, prefix, shift, p == 0), shift)
            k_rem, prefix, go = _narrow(hist, k_rem, prefix, shift)
            level = shift
    return k_rem, prefix, level


@triton.jit
def _select(key, valid, t_hi, level, k_rem, n_sel, n_eq):
    """The entries (in index order from position n_sel) whose key is above T's decided bits ``t_hi`` (key >>
    level), or equal to them among the first k_rem such (n_eq of them seen before). Returns (selected, their
    positions, the new n_sel, the new n_eq)."""
    hi = key >> level  # arithmetic shift: monotone in the signed key
    eq = (valid & (hi == t_hi)).to(tl.int32)
    eq_rank = n_eq + tl.cumsum(eq, axis=0) - 1
    sel = (valid & (hi > t_hi)) | ((eq == 1) & (eq_rank < k_rem))
    sel_i = sel.to(tl.int32)
    pos = n_sel + tl.cumsum(sel_i, axis=0) - 1
    return sel, pos, n_sel + tl.sum(sel_i, axis=0), n_eq + tl.sum(eq, axis=0)


@triton.jit
def _table_rows(e, sel, tab, W, R, OFFSET):
    """Pool rows of entries ``e`` (int32, >= 0) through a request's block table ``tab`` (W block ids), as
    ``paged_rows``: tab[e // R] * R + e % R + OFFSET, -1 past the table (e // R >= W). The table is read at ``sel``
    alone (the selected entries). An entry number and R fit 32 bits, so the division is 32-bit (a 64-bit one is a
    long subroutine per element, and spilled the 8192-entry block kernel's registers); the row is int64 (block
    ids times R exceed 2^31 in big pools)."""
    block = e // R
    ok = block < W
    t = tl.load(tab + block, mask=sel & ok, other=0)
    return tl.where(ok, t * R + e % R + OFFSET, -1)


@triton.jit
def _compact(dst, idx, key, valid, t_hi, level, k_rem, n_sel, n_eq, tab, W, R, OFFSET, HAS_MAP: tl.constexpr):
    """``_select``, writing the selected entries' ``idx`` at their positions of ``dst`` (with HAS_MAP their pool
    rows through ``tab``: ``_table_rows``). Returns the new (n_sel, n_eq)."""
    sel, pos, n_sel, n_eq = _select(key, valid, t_hi, level, k_rem, n_sel, n_eq)
    if HAS_MAP:
        tl.store(dst + pos, _table_rows(idx, sel, tab, W, R, OFFSET), mask=sel)
    else:
        tl.store(dst + pos, idx.to(tl.int64), mask=sel)
    return n_sel, n_eq


@triton.jit
def _copy_prefix(dst, row, pre_ptr, n_pre):
    """A row-mapped output row ``dst``'s first n_pre columns: row ``row`` of the prefix [rows, n_pre] (contiguous)."""
    pre = pre_ptr + row * n_pre
    for f in range(0, n_pre, PREFIX_BLOCK):
        j = f + tl.arange(0, PREFIX_BLOCK)
        tl.store(dst + j, tl.load(pre + j, mask=j < n_pre), mask=j < n_pre)


@triton.jit
def _map_row(dst, row, t_ptr, W, n_pre):
    """A row-mapped output row ``dst``: where its picks go (after the n_pre prefix columns) and its request's block
    table (row ``row`` of [rows, W] ``t_ptr``, contiguous)."""
    return dst + n_pre, t_ptr + row * W


@triton.jit
def _select_parts(
    dst, ids, key, valid, in_row, ids_t, key_t, valid_t, in_tail, K, fill_to, tab, W, R, OFFSET, BLOCK: tl.constexpr,
    TAIL: tl.constexpr, HAS_MAP: tl.constexpr,
):  # fmt: skip
    """The top K of keys held in registers as a power-of-two block plus, when TAIL > 0, a power-of-two tail that
    follows it in index order (``register_parts``; the ``*_t`` arguments are not read otherwise): the radix passes,
    the compaction of the selected ``ids`` (with HAS_MAP their pool rows through ``tab``, ``_compact``) to ``dst``
    in order (block, then tail), then -1 at output positions from the selected count up to ``fill_to``."""
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    if TAIL > 0:
        n_valid += tl.sum(valid_t.to(tl.int32), axis=0)
    k_rem, prefix, level = _radix(key, in_row, key_t, in_tail, tl.minimum(K, n_valid), TAIL)
    t_hi = (prefix ^ INT_MIN) >> level
    zero = tl.zeros([], dtype=tl.int32)
    n_sel, n_eq = _compact(dst, ids, key, valid, t_hi, level, k_rem, zero, zero, tab, W, R, OFFSET, HAS_MAP)
    if TAIL > 0:
        n_sel, n_eq = _compact(dst, ids_t, key_t, valid_t, t_hi, level, k_rem, n_sel, n_eq, tab, W, R, OFFSET, HAS_MAP)
        pos_t = BLOCK + tl.arange(0, TAIL)
        tl.store(dst + pos_t, tl.full([TAIL], -1, tl.int64), mask=(pos_t >= n_sel) & (pos_t < fill_to))
    pos = tl.arange(0, BLOCK)
    tl.store(dst + pos, tl.full([BLOCK], -1, tl.int64), mask=(pos >= n_sel) & (pos < fill_to))


@triton.jit
def _row_length(len_ptr, row, N, HAS_LEN: tl.constexpr):
    length = N
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + row), 0), N).to(tl.int32)
    return length


@triton.jit
def _topk_select_block_kernel(
    s_ptr, len_ptr, m_ptr, out_ptr, N, K, s_stride, m_stride, out_stride, t_ptr, pre_ptr, W, R, OFFSET, n_pre,
    HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr = 0,
    PDL: tl.constexpr = False, HAS_MAP: tl.constexpr = False,
):  # fmt: skip
    """A row of N <= BLOCK + TAIL entries, read once: the radix passes and the compaction work on its keys in
    registers, entries [0, BLOCK) and, when TAIL > 0, [BLOCK, BLOCK + TAIL) (``register_parts``). HAS_MAP: the
    picks' pool rows after the row's prefix, which this program copies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * s_stride
    msk = m_ptr + row * m_stride
    dst = out_ptr + row * out_stride
    tab = t_ptr  # read with HAS_MAP alone
    if HAS_MAP:
        _copy_prefix(dst, row, pre_ptr, n_pre)
        dst, tab = _map_row(dst, row, t_ptr, W, n_pre)
    length = _row_length(len_ptr, row, N, HAS_LEN)
    idx = tl.arange(0, BLOCK)
    in_row = idx < N
    key, valid = _keys(src, idx, N, length, msk, HAS_MASK)
    if TAIL > 0:
        idx_t = BLOCK + tl.arange(0, TAIL)
        in_tail = idx_t < N
        key_t, valid_t = _keys(src, idx_t, N, length, msk, HAS_MASK)
    else:
        idx_t, in_tail, key_t, valid_t = idx, in_row, key, valid  # not read
    _select_parts(
        dst, idx, key, valid, in_row, idx_t, key_t, valid_t, in_tail, K, K, tab, W, R, OFFSET, BLOCK, TAIL, HAS_MAP
    )


@triton.jit
def _topk_select_split_kernel(
    s_ptr, len_ptr, m_ptr, out_ptr, ck_ptr, ci_ptr, cnt_ptr, N, K, s_stride, m_stride, out_stride, P, t_ptr, pre_ptr,
    W, R, OFFSET, n_pre, HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, CAND: tl.constexpr,
    CAND_TAIL: tl.constexpr = 0, PDL: tl.constexpr = False, HAS_MAP: tl.constexpr = False,
):  # fmt: skip
    """Piece ``program_id(1)`` (CHUNK entries, read once) of a row: its top K as candidates (key, index) at
    [row, piece * K ...) of ``ck`` / ``ci`` (INT_MIN keys past the chosen ones); the row's last piece to finish
    selects the row's top K among its P * K candidates (CAND + CAND_TAIL >= P * K, as the block kernel's BLOCK and
    TAIL) and resets the counter. HAS_MAP: the picks' pool rows after the row's prefix, which piece 0 copies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    idx = piece * CHUNK + tl.arange(0, CHUNK)
    in_piece = idx < N
    length = _row_length(len_ptr, row, N, HAS_LEN)
    key, valid = _keys(s_ptr + row * s_stride, idx, N, length, m_ptr + row * m_stride, HAS_MASK)
    if HAS_MAP:
        if piece == 0:  # the row's prefix, while the pieces select
            _copy_prefix(out_ptr + row * out_stride, row, pre_ptr, n_pre)
    k_rem, prefix, level = _radix(key, in_piece, key, in_piece, tl.minimum(K, tl.sum(valid.to(tl.int32), axis=0)), 0)
    zero = tl.zeros([], dtype=tl.int32)
    sel, pos, n_sel, _ = _select(key, valid, (prefix ^ INT_MIN) >> level, level, k_rem, zero, zero)
    base = (row * P + piece) * K
    tl.store(ck_ptr + base + pos, key, mask=sel)
    tl.store(ci_ptr + base + pos, idx, mask=sel)
    j = tl.arange(0, CHUNK)
    tl.store(ck_ptr + base + j, tl.full([CHUNK], INT_MIN, tl.int32), mask=(j >= n_sel) & (j < K))
    tl.debug_barrier()  # every thread's candidates are written before the one release below
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == P - 1:  # the row's last piece
        cbase = row * P * K
        c = tl.arange(0, CAND)
        c_in = c < P * K
        ckey = tl.load(ck_ptr + cbase + c, mask=c_in, other=INT_MIN, cache_modifier=".cg")
        cidx = tl.load(ci_ptr + cbase + c, mask=c_in, other=0, cache_modifier=".cg")
        cvalid = ckey != INT_MIN  # a selectable entry's key never is INT_MIN (only NaN bit patterns map there)
        if CAND_TAIL > 0:
            c_t = CAND + tl.arange(0, CAND_TAIL)
            c_in_t = c_t < P * K
            ckey_t = tl.load(ck_ptr + cbase + c_t, mask=c_in_t, other=INT_MIN, cache_modifier=".cg")
            cidx_t = tl.load(ci_ptr + cbase + c_t, mask=c_in_t, other=0, cache_modifier=".cg")
            cvalid_t = ckey_t != INT_MIN
        else:
            c_in_t, ckey_t, cidx_t, cvalid_t = c_in, ckey, cidx, cvalid  # not read
        dst = out_ptr + row * out_stride
        tab = t_ptr  # read with HAS_MAP alone
        if HAS_MAP:
            dst, tab = _map_row(dst, row, t_ptr, W, n_pre)
        _select_parts(
            dst, cidx, ckey, cvalid, c_in, cidx_t, ckey_t, cvalid_t, c_in_t, K, tl.minimum(K, N), tab, W, R, OFFSET,
            CAND, CAND_TAIL, HAS_MAP,
        )  # fmt: skip
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _grid_barrier(cnt_ptr, target):
    """Wait until ``target`` arrivals on the row's counter, this program's one included: the CTA barrier orders every
    thread's writes before the one release, the acquire orders the reads after it before every thread's."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _topk_select_grid_kernel(
    s_ptr, len_ptr, m_ptr, out_ptr, ws_ptr, cn_ptr, cnt_ptr, N, K, s_stride, m_stride, out_stride, P, t_ptr, pre_ptr,
    W, R, OFFSET, n_pre, HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, P_MAX: tl.constexpr,
    PDL: tl.constexpr = False, HAS_MAP: tl.constexpr = False,
):  # fmt: skip
    """Piece ``program_id(1)`` (CHUNK entries, read once, held in registers) of a row whose P pieces run as one
    selection: each radix pass adds the pieces' histograms in the row's zeroed workspace ``ws`` (GRID_WS words: a
    256-bin histogram per pass, then the count of selectable entries) and waits for all P (``_grid_barrier`` on the
    row's counter), so every piece takes the same decisions; then each piece publishes its counts above / at T
    (``cn``), waits, and writes its selected entries at the positions the pieces before it leave (ties: the lower
    index first, across pieces). The last piece to leave zeroes the workspace and the counters. HAS_MAP: the picks'
    pool rows after the row's prefix, which piece 0 copies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    ws = ws_ptr + row * GRID_WS
    cnt = cnt_ptr + 2 * row  # arrivals, then departures
    idx = piece * CHUNK + tl.arange(0, CHUNK)
    in_piece = idx < N
    length = _row_length(len_ptr, row, N, HAS_LEN)
    key, valid = _keys(s_ptr + row * s_stride, idx, N, length, m_ptr + row * m_stride, HAS_MASK)
    if HAS_MAP:
        if piece == 0:  # the row's prefix, while the passes run
            _copy_prefix(out_ptr + row * out_stride, row, pre_ptr, n_pre)
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], dtype=tl.int32)
    level = tl.full([], 32, dtype=tl.int32)
    k_rem = tl.zeros([], dtype=tl.int32)
    go = tl.full([], 1, dtype=tl.int32)
    arrived = tl.zeros([], dtype=tl.int32)
    for p in range(4):
        if go != 0:
            shift = 24 - 8 * p
            hist = _digit_hist(key, _in_bucket(key, in_piece, prefix, shift, p == 0), shift)
            tl.atomic_add(ws + p * 256 + bins, hist, mask=hist != 0, sem="relaxed", scope="gpu")
            if p == 0:
                tl.atomic_add(ws + 4 * 256, tl.sum(valid.to(tl.int32), axis=0), sem="relaxed", scope="gpu")
            arrived += P
            _grid_barrier(cnt, arrived)
            hist = tl.load(ws + p * 256 + bins, cache_modifier=".cg")
            if p == 0:
                k_rem = tl.minimum(K, tl.load(ws + 4 * 256, cache_modifier=".cg"))
            k_rem, prefix, go = _narrow(hist, k_rem, prefix, shift)
            level = shift
    t_hi = (prefix ^ INT_MIN) >> level
    hi = key >> level
    tl.store(cn_ptr + (row * P + piece) * 2, tl.sum((valid & (hi > t_hi)).to(tl.int32), axis=0))
    tl.store(cn_ptr + (row * P + piece) * 2 + 1, tl.sum((valid & (hi == t_hi)).to(tl.int32), axis=0))
    _grid_barrier(cnt, arrived + P)
    j = tl.arange(0, P_MAX)
    before = j < piece
    above = tl.sum(tl.load(cn_ptr + (row * P + j) * 2, mask=before, other=0, cache_modifier=".cg"), axis=0)
    n_eq = tl.sum(tl.load(cn_ptr + (row * P + j) * 2 + 1, mask=before, other=0, cache_modifier=".cg"), axis=0)
    dst = out_ptr + row * out_stride
    tab = t_ptr  # read with HAS_MAP alone
    if HAS_MAP:
        dst, tab = _map_row(dst, row, t_ptr, W, n_pre)
    n_sel, _ = _compact(
        dst, idx, key, valid, t_hi, level, k_rem, above + tl.minimum(n_eq, k_rem), n_eq, tab, W, R, OFFSET, HAS_MAP
    )
    if piece == P - 1:  # its count is the row's: -1 past it, up to the output's width
        width = tl.minimum(K, N)
        for f in range(0, width, CHUNK):
            pos = f + tl.arange(0, CHUNK)
            tl.store(dst + pos, tl.full([CHUNK], -1, tl.int64), mask=(pos >= n_sel) & (pos < width))
    tl.debug_barrier()  # every thread's reads are done before the departure
    if tl.atomic_add(cnt + 1, 1, sem="acq_rel", scope="gpu") == P - 1:  # the last to leave: no one reads ws now
        w = tl.arange(0, GRID_WS_POW2)
        tl.store(ws + w, tl.zeros([GRID_WS_POW2], dtype=tl.int32), mask=w < GRID_WS)
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(cnt + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _topk_select_kernel(
    s_ptr, len_ptr, m_ptr, out_ptr, N, K, s_stride, m_stride, out_stride, t_ptr, pre_ptr, W, R, OFFSET, n_pre,
    HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
    HAS_MAP: tl.constexpr = False,
):  # fmt: skip
    """A row of any length, streamed in BLOCK chunks by every pass. HAS_MAP: the picks' pool rows after the row's
    prefix, which this program copies."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    src = s_ptr + row * s_stride
    msk = m_ptr + row * m_stride
    dst = out_ptr + row * out_stride
    tab = t_ptr  # read with HAS_MAP alone
    if HAS_MAP:
        _copy_prefix(dst, row, pre_ptr, n_pre)
        dst, tab = _map_row(dst, row, t_ptr, W, n_pre)
    length = _row_length(len_ptr, row, N, HAS_LEN)
    offs = tl.arange(0, BLOCK)

    # prefix: the decided high bits of T's unsigned-order key; level: how many low bits are still undecided
    prefix = tl.zeros([], dtype=tl.int32)
    k_rem = tl.zeros([], dtype=tl.int32)
    level = tl.full([], 32, dtype=tl.int32)
    go = tl.full([], 1, dtype=tl.int32)
    for p in tl.static_range(4):
        if go != 0:
            hist = tl.zeros([256], dtype=tl.int32)
            n_valid = tl.zeros([], dtype=tl.int32)
            for start in range(0, N, BLOCK):
                idx = start + offs
                key, valid = _keys(src, idx, N, length, msk, HAS_MASK)
                if p == 0:
                    n_valid += tl.sum(valid.to(tl.int32), axis=0)
                    hist += _digit_hist(key, idx < N, 24)
                else:
                    match = _in_bucket(key, idx < N, prefix, 24 - 8 * p, False)
                    if tl.sum(match.to(tl.int32), axis=0) > 0:  # later passes: most chunks miss the bucket
                        hist += _digit_hist(key, match, 24 - 8 * p)
            if p == 0:
                k_rem = tl.minimum(K, n_valid)
            k_rem, prefix, go = _narrow(hist, k_rem, prefix, 24 - 8 * p)
            level = level * 0 + (24 - 8 * p)

    t_hi = (prefix ^ INT_MIN) >> level
    n_sel = tl.zeros([], dtype=tl.int32)
    n_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        key, valid = _keys(src, idx, N, length, msk, HAS_MASK)
        n_sel, n_eq = _compact(dst, idx, key, valid, t_hi, level, k_rem, n_sel, n_eq, tab, W, R, OFFSET, HAS_MAP)
    for start in range(0, K, BLOCK):
        idx = start + offs
        tl.store(dst + idx, tl.full([BLOCK], -1, tl.int64), mask=(idx >= n_sel) & (idx < K))


def block_warps(block: int) -> int:
    """Warps of a program holding ``block`` keys in registers. H200, one row in a CUDA graph (bench_topk_select.py):
    8 warps best for 1K-4K entries (4.6 / 12.3 us; 16 warps 6.0 / 15.6), 16 for 8K (23.5 us; 8 warps 27.8)."""
    return 4 if block <= 512 else 8 if block <= 4096 else 16


def register_parts(n: int, min_warps: int = 1) -> tuple[int, int, int]:
    """(BLOCK, TAIL, num_warps): n entries held in registers as a power of two BLOCK plus a power-of-two TAIL (0:
    none) of at least one element a thread, where that is fewer than the next power of two. Why: a decode step's
    rows are as wide as its bucketed block tables, just past a power of two more often than not (4K tokens: 5120
    entries at ratio 1), and the passes cost what the registers hold (5120 = 4096 + 1024, not 8192 at 16 warps)."""
    full = max(128, triton.next_power_of_2(n))
    block = full // 2
    warps = max(min_warps, block_warps(block))
    tail = max(triton.next_power_of_2(max(n - block, 1)), 32 * warps)
    if block >= 128 and block + tail < full:
        return block, tail, warps
    return full, 0, max(min_warps, block_warps(full))


def split_config(n: int, k: int, chunk: int = SPLIT_CHUNK) -> tuple[int, int, int, int] | None:
    """(pieces a row, CAND, CAND_TAIL, num_warps) of the split kernel for rows of n entries and k picks: the pieces'
    P * k candidates held as ``register_parts`` does, the warps serving both phases; None where it does not apply (k
    above a piece, or more candidates than SPLIT_CAND_MAX)."""
    pieces = triton.cdiv(n, chunk) if chunk else 0
    if not chunk or k > chunk or pieces * k > SPLIT_CAND_MAX:
        return None
    cand, tail, warps = register_parts(pieces * k, block_warps(chunk))
    return pieces, cand, tail, warps


def grid_plan(n: int, rows: int, sms: int, chunk: int | None = None) -> tuple[int, int] | None:
    """(entries a piece, pieces a row) of the grid kernel (``_topk_select_grid_kernel``): the smallest of
    GRID_CHUNKS (or ``chunk``) whose rows x pieces programs fit the SMs, since every piece of a row must be resident
    while the others wait at its barriers (within one program per SM they are, whatever else runs), in at least
    GRID_MIN_PIECES pieces unless ``chunk`` forces it (fewer pay the barriers for little parallelism); None where
    none does, or under the interpreter (it runs programs one after another)."""
    if interpreting():
        return None
    if rows * GRID_WS_WORDS > SCRATCH_WORDS or 2 * rows > COUNTERS:
        return None
    for c in (chunk,) if chunk else GRID_CHUNKS:
        pieces = triton.cdiv(n, c)
        if rows * pieces <= sms and (chunk or pieces >= GRID_MIN_PIECES):
            return c, pieces
    return None


def _kernel_row_map(row_map: tuple, scores: torch.Tensor, out: torch.Tensor) -> tuple:
    """The kernels' row-map arguments (tables, prefix, W, R, offset, P) for the rows of ``scores``: a table row and a
    prefix row for every score row, contiguous (a copy only where a request has several query rows; a decode step
    has one). ``out`` stands in for a pointer that is never read (no prefix, or tables of width 0)."""
    tables, rpb, offset, prefix = row_map
    rows = scores.shape[0]
    if tables.shape[0] == 0 or rows % tables.shape[0]:
        raise ValueError(f"row_map: {rows} score rows are no whole number of requests (tables {tuple(tables.shape)})")
    require_same_device(scores, tables, *([prefix] if prefix is not None else []))
    per = rows // tables.shape[0]  # query rows a request
    tables = (tables if per == 1 else tables.repeat_interleave(per, 0)).contiguous()
    n_pre = 0 if prefix is None else prefix.shape[1]
    if n_pre:
        prefix = (prefix if per == 1 else prefix.repeat_interleave(per, 0)).contiguous()
    return tables if tables.shape[1] else out, prefix if n_pre else out, tables.shape[1], rpb, offset, n_pre


def topk_select_triton(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None, *,
    row_map: tuple | None = None, block: int | None = None, num_warps: int | None = None,
    block_row_max: int | None = None, chunk: int | None = None, split_programs: int | None = None,
    grid_min: int | None = None, grid_chunk: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The op (contract in ``__init__.py``). Rows of at least ``grid_min`` entries take the grid kernel where its
    pieces fit the SMs (``grid_plan``; ``grid_chunk`` forces a piece size, 0 turns the kernel off); else rows of at
    most ``block_row_max`` entries the register-resident kernel (its tiling from ``register_parts``), longer ones
    the split kernel in ``chunk``-entry pieces (``split_config``; 0 turns it off) while rows x pieces is at most
    ``split_programs``, or else the streaming kernel, tiled by ``block`` / ``num_warps``. All are exposed for the
    benchmark's sweep and the tests (``block_row_max=0`` skips the register kernel); left None, each is the module
    global of its name in capitals (read at the call, so that a benchmark's ``--set`` changes it).

    ``row_map`` (``indexer_topk``'s, which checks it; the public ``topk_select`` has none) = (tables [B, W] int64,
    rows_per_block R, offset, prefix [B, P] int64 or None), B dividing S (scores row r is request r // (S / B)'s):
    the result is then [S, P + min(k, N)] int64, each row ``paged_rows(picks, tables, R, offset, prefix=prefix)``
    of its request, written by the kernels themselves."""
    block = BLOCK if block is None else block
    num_warps = NUM_WARPS if num_warps is None else num_warps
    block_row_max = BLOCK_ROW_MAX if block_row_max is None else block_row_max
    chunk = SPLIT_CHUNK if chunk is None else chunk
    split_programs = SPLIT_MAX_PROGRAMS if split_programs is None else split_programs
    grid_min = GRID_MIN if grid_min is None else grid_min
    s, n = scores.shape
    width = min(k, n)
    n_pre = 0 if row_map is None or row_map[3] is None else row_map[3].shape[1]
    out = torch.empty(s, n_pre + width, dtype=torch.int64, device=scores.device)
    if s == 0:
        return out
    rmap = (out, out, 0, 1, 0, 0) if row_map is None else _kernel_row_map(row_map, scores, out)
    if width == 0:  # no picks: the prefix alone, if any
        return out.copy_(rmap[1]) if n_pre else out
    require_same_device(scores, *[t for t in (lengths, mask) if t is not None])
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    lens = lengths.contiguous() if lengths is not None else scores  # dummy pointer when absent
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    msk = mask if mask is not None else scores  # dummy pointer when absent
    common = dict(
        HAS_LEN=lengths is not None, HAS_MASK=mask is not None, HAS_MAP=row_map is not None,
        **pdl_options(scores.device),
    )  # fmt: skip
    grid = None
    if n >= grid_min and grid_chunk != 0:
        grid = grid_plan(n, s, sm_count(scores.device), grid_chunk)
    split = split_config(n, width, chunk) if grid is None and n > block_row_max and s <= COUNTERS else None
    if split is not None and s * split[0] > split_programs:
        split = None
    if grid is not None:
        piece, pieces = grid
        counts = torch.empty(s, pieces, 2, dtype=torch.int32, device=scores.device)
        _topk_select_grid_kernel[(s, pieces)](
            scores, lens, msk, out, zeroed_scratch(scores.device), counts, counter_block(scores.device), n, width,
            scores.stride(0), msk.stride(0), out.stride(0), pieces, *rmap, CHUNK=piece,
            P_MAX=max(2, triton.next_power_of_2(pieces)), num_warps=block_warps(piece), **common,
        )  # fmt: skip
    elif n <= block_row_max:
        block, tail, warps = register_parts(n)
        _topk_select_block_kernel[(s,)](
            scores, lens, msk, out, n, width, scores.stride(0), msk.stride(0), out.stride(0), *rmap, BLOCK=block,
            TAIL=tail, num_warps=warps, **common,
        )  # fmt: skip
    elif split is not None:
        pieces, cand, cand_tail, warps = split
        ck = torch.empty(s, pieces * width, dtype=torch.int32, device=scores.device)
        ci = torch.empty_like(ck)
        _topk_select_split_kernel[(s, pieces)](
            scores, lens, msk, out, ck, ci, counter_block(scores.device), n, width, scores.stride(0), msk.stride(0),
            out.stride(0), pieces, *rmap, CHUNK=chunk, CAND=cand, CAND_TAIL=cand_tail, num_warps=warps, **common,
        )  # fmt: skip
    else:
        _topk_select_kernel[(s,)](
            scores, lens, msk, out, n, width, scores.stride(0), msk.stride(0), out.stride(0), *rmap, BLOCK=block,
            num_warps=num_warps, **common,
        )  # fmt: skip
    return out


register_backend(
    "topk_select", "triton", topk_select_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

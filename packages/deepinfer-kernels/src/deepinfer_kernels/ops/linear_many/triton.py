"""``linear_many`` in one launch at decode sizes (CUDA backend ``triton_skinny``): every weight's column blocks in
one grid, each program running ``linear``'s skinny tile (``ops/linear/triton_skinny.py``: a tensor-core tile of x
against a [BLOCK_N, K_SPLIT] weight block, fp32 partials, the last program of a (row, column) block adds the K splits
in split order).

* Up to ``SKINNY_MAX_ROWS`` rows (``decode_tiling``): one 16-row tile against [32, 1024] weight blocks, 3 stages.
  A small projection costs its launch and ramp (4-6 us for a 2-8 MB weight on an H200), not its bytes; an
  attention layer reads its normed input with up to seven of them (12-34 MB), and a set takes one wave of programs.
* Up to ``MID_MAX_ROWS`` rows (batches of 9-256 requests, ``mid_tiling``), for sets of narrow weights (at most
  ``MID_MAX_PART_N`` rows each: an attention layer's): 64- or 128-row tiles against 64-column blocks, K cut into
  just enough splits to give every SM a program. cuBLAS takes such calls one weight at a time, with tilings picked
  for a lone [M, K] x [K, N] product: at 256 rows V4's seven attention projections (34 MB) took seven to eleven
  launches and ~60 us (H200, session 13), against ~9 us for their bytes and ~11 us for their math.

Serves bf16 / fp16 x, up to ``MAX_PARTS`` weights of x's dtype, each at most ``MAX_PART_N`` rows; anything else runs
the per-weight loop (``linear`` each). Deterministic (fixed tiling and split order per shape and row tier) but, like
the skinny ``linear``, not batch-invariant: batch-invariant mode takes the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import (
    COUNTERS,
    counter_block,
    interpreting,
    pdl_options,
    sm_count,
    triton_cuda_available,
)
from deepinfer_kernels.ops.linear.triton_skinny import (
    BLOCK_K,
    SKINNY_MAX_ROWS,
    Tiling,
    even_k_split,
    skinny_tile,
)
from deepinfer_kernels.registry import register_backend

from .reference import linear_many_loop

MAX_PARTS = 8  # weights one launch takes (the kernel has a fixed argument list)
MAX_PART_N = 4096  # rows of one weight; wider ones (q up-projections, 16-64 MB) are bandwidth-bound on their own
BLOCK_N = 32  # weight rows a program takes up to SKINNY_MAX_ROWS rows of x
MID_MAX_ROWS = 256  # rows of x the mid-size tiling serves; more go to the per-weight loop (cuBLAS)
MID_MAX_PART_N = 1280  # and only sets of narrow weights: cuBLAS was faster on the shared experts' 2048-2304 rows
MID_MIN_SPLIT_K = 512  # columns of K a split keeps at least (shorter splits cost more in partials than they add)
DECODE_K_SPLIT, DECODE_STAGES = 1024, 3  # up to SKINNY_MAX_ROWS rows: K splits of at most this many columns


def decode_tiling(k: int) -> Tiling:
    """Up to SKINNY_MAX_ROWS rows: 32-row weight blocks, K in even splits of at most DECODE_K_SPLIT columns walked
    128 a step, 4 warps, 3 stages (36 KB of shared memory a program). The single ``linear``'s narrow tiling
    (512-column splits, 4 stages: 48 KB) made a set of 12-45 MB 400-1400 programs, and each column block added 8-10
    partials. H200, each call streaming its weights from HBM (``bench_linear.py --many-cold``, session 23,
    ``benchmarks/baselines/bench_linear_many_cold_h200_session23.log``), M = 1, us old -> new: V4's CSA attention set
    15.9 -> 11.5, HCA 10.0 -> 9.1, SWA 7.0 -> 7.6, shared gate + up 15.8 -> 11.5; V4.1's attention 15.4 -> 11.0, SWA
    10.1 -> 9.0, shared gate + up 18.2 -> 19.7 (1024-column splits at 4 stages: 8.7, 8.8 and 16.4 for HCA, V4.1's SWA
    and V4.1's shared expert, not measured in whole steps). Whole decode steps, same lease, alternating twice, ms:
    V4 batch 1 at 4K 1.119 / 1.123 -> 1.099 / 1.099, at 32K 1.166 / 1.165 -> 1.145 / 1.147; V4.1 batch 1 at 4K
    2.341 / 2.335 -> 2.315 / 2.320, at 32K 2.434 / 2.441 -> 2.428 / 2.428; batch 8 0.005-0.02 ms faster."""
    k_split, split = even_k_split(k, DECODE_K_SPLIT, BLOCK_K)
    return Tiling(BLOCK_N, BLOCK_K, k_split, split, 4, DECODE_STAGES)


def mid_tiling(m: int, ns: list[int], k: int, sms: int) -> Tiling:
    """9 to MID_MAX_ROWS rows: 64 x 64 tiles, or 128 x 64 past 128 rows where 64-row tiles would be more than one
    wave of programs; K walked 128 columns a step in 3 stages, 4 warps, and split by ``k_splits``. H200 sweep
    (``bench_linear.py --many``, the V4 / V4.1 attention sets at 16 / 64 / 128 / 256 rows): the best candidate or
    within 15% of it everywhere, 1.2-4.3x the per-weight loop's speed (the sliding-window sets at 256 rows were
    0.93x with 128-row tiles, hence the wave rule)."""
    blocks = sum(triton.cdiv(n, 64) for n in ns)
    bm = 128 if m > 128 and triton.cdiv(m, 64) * blocks > sms else 64
    k_split, split = k_splits(triton.cdiv(m, bm) * blocks, k, sms, 128)
    return Tiling(64, 128, k_split, split, 4, 3, block_m=bm)


def k_splits(tiles: int, k: int, sms: int, block_k: int) -> tuple[int, int]:
    """(columns per split, splits) for ``tiles`` output tiles: K in as many even splits as the tiles fit ``sms``
    times (at least MID_MIN_SPLIT_K columns each), so about one wave of programs."""
    want = max(1, min(sms // tiles, k // MID_MIN_SPLIT_K))
    return even_k_split(k, triton.cdiv(k, want), block_k)


@triton.jit
def _part(
    x_ptr, w_ptr, o_ptr, n, lo, hi, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(2)
    if (pid_n >= lo) & (pid_n < hi):  # this program's column block belongs to the weight of tiles [lo, hi)
        skinny_tile(
            x_ptr, w_ptr, o_ptr, ws_ptr, cnt_ptr + pid_m * TILES + pid_n, pid_n - lo, tl.program_id(1), M, n, K,
            K_SPLIT, SPLIT, WS_N, lo * BLOCK_N, pid_m * BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT,
        )  # fmt: skip


@triton.jit
def _many_kernel(
    x_ptr, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES,
    w0, o0, n0, e0, w1, o1, n1, e1, w2, o2, n2, e2, w3, o3, n3, e3,
    w4, o4, n4, e4, w5, o5, n5, e5, w6, o6, n6, e6, w7, o7, n7, e7,
    PARTS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Weight p owns column blocks [e_{p-1}, e_p) of the grid (e_{-1} = 0; TILES = e_last) and writes o_p (its own
    dtype); grid axis 1 walks the K splits, axis 2 the BM-row blocks of x."""
    pdl_prologue(PDL)
    _part(x_ptr, w0, o0, n0, 0, e0, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 1:
        _part(x_ptr, w1, o1, n1, e0, e1, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 2:
        _part(x_ptr, w2, o2, n2, e1, e2, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 3:
        _part(x_ptr, w3, o3, n3, e2, e3, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 4:
        _part(x_ptr, w4, o4, n4, e3, e4, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 5:
        _part(x_ptr, w5, o5, n5, e4, e5, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 6:
        _part(x_ptr, w6, o6, n6, e5, e6, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)
    if PARTS > 7:
        _part(x_ptr, w7, o7, n7, e6, e7, ws_ptr, cnt_ptr, M, K, K_SPLIT, SPLIT, WS_N, TILES, BM, BN, BK, F32_DOT)


def serves(x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list) -> bool:
    """Whether ``linear_many_skinny`` takes the call in one launch (else the per-weight loop)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    mid = m > SKINNY_MAX_ROWS
    bn = 64 if mid else BLOCK_N
    return (
        0 < m <= MID_MAX_ROWS
        and not (mid and any(w.shape[0] > MID_MAX_PART_N for w in weights))
        and k > 0
        and len(weights) <= MAX_PARTS
        and x.dtype in (torch.bfloat16, torch.float16)
        and all(w.dtype == x.dtype and 0 < w.shape[0] <= MAX_PART_N for w in weights)
        and all(dt in (None, torch.float32) for dt in out_dtypes)
        and sum(triton.cdiv(w.shape[0], bn) for w in weights) * triton.cdiv(m, 64) <= COUNTERS  # row blocks >= 64
    )


def linear_many_skinny(
    x: torch.Tensor, weights: list[torch.Tensor], out_dtypes: list, cfg: Tiling | None = None
) -> list[torch.Tensor]:
    """``linear_many`` in one launch where ``serves`` says so; the per-weight loop otherwise. ``cfg`` overrides
    the tiling (tests, benchmarks)."""
    if not serves(x, weights, out_dtypes):
        return linear_many_loop(x, weights, out_dtypes)
    k = x.shape[-1]
    lead = x.shape[:-1]
    a = x.reshape(-1, k).contiguous()
    m = a.shape[0]
    mats = [w.contiguous() for w in weights]
    t = cfg or (
        decode_tiling(k) if m <= SKINNY_MAX_ROWS else mid_tiling(m, [w.shape[0] for w in mats], k, sm_count(a.device))
    )
    outs = [torch.empty(m, w.shape[0], dtype=dt or x.dtype, device=x.device) for w, dt in zip(mats, out_dtypes)]
    ends, total = [], 0
    for w in mats:
        total += triton.cdiv(w.shape[0], t.block_n)
        ends.append(total)
    m_tiles = triton.cdiv(m, t.block_m)
    if total * m_tiles > COUNTERS:
        return linear_many_loop(x, weights, out_dtypes)
    ws = torch.empty(t.split, m, total * t.block_n, dtype=torch.float32, device=x.device) if t.split > 1 else outs[0]
    parts = []
    for p in range(MAX_PARTS):  # unused slots repeat the first weight; PARTS keeps them out of the kernel
        q = p if p < len(mats) else 0
        parts += [mats[q], outs[q], mats[q].shape[0], ends[q] if p < len(mats) else total]
    _many_kernel[(total, t.split, m_tiles)](
        a, ws, counter_block(x.device), m, k, t.k_split, t.split, total * t.block_n, total, *parts,
        PARTS=len(mats), BM=t.block_m, BN=t.block_n, BK=t.block_k, F32_DOT=interpreting(),
        num_warps=t.warps, num_stages=t.stages, **pdl_options(a.device),
    )  # fmt: skip
    return [o.reshape(*lead, o.shape[1]) for o in outs]


register_backend(
    "linear_many", "triton_skinny", linear_many_skinny, devices=("cuda",), priority=30,
    available=triton_cuda_available, batch_invariant=False,
)  # fmt: skip

"""The decode-size GPU backend of ``linear`` (``triton_skinny``): y = x W^T for at most ``SKINNY_MAX_ROWS`` rows of
bf16 / fp16 x against a weight of the same dtype that is narrow (at most ``SKINNY_MAX_N`` rows) or large enough to
stream (``STREAM_MIN_ELEMS``), in one launch; every other call goes to cuBLAS (``cublas.py``).

At decode sizes a projection is a weight stream: [M <= 8, K] x [N, K]^T reads N K 2 bytes and does almost no math.
cuBLAS splits K there too, but finishes with a second reduce kernel (and its launch gap). Here program (n, s)
streams the [BLOCK_N, K_SPLIT] weight block (n, s) once (one 16-row tensor-core tile of x against it, fp32
accumulation, K walked in BLOCK_K steps in order), writes its fp32 partial [M, BLOCK_N], and the last program of
column block n to arrive (a counter per column block, taken with an acq_rel atomic after a CTA barrier, the pattern
of CUTLASS's semaphore) adds the SPLIT partials in split order, casts and stores, then resets the counter for the
next launch (CUDA-graph safe: no memset node, no host work).

H200 sweep (session 8, CUDA graphs, M = 1 / 8): N <= 1024 with K = 4096 / 5120 takes 4.2-5.7 us against cuBLAS's
5.7-6.8 us (e.g. [1, 4096] x [512, 4096]: 4.6 against 6.3 us); from N = 2048 on cuBLAS is as fast or faster, so
mid-size weights stay there, except at batch 1-2 up to N = 2304 (64-column blocks: [1, 5120] x [2304, 5120] 8.0
against 9.0 us, the V4.1 compressors). 32-column blocks and 512-column K splits were the best tiling for every narrow
shape measured.

Weight streams (session 13 sweep, ``bench_linear.py --stream``: graphs of calls on rotating weight copies, so each
streams from HBM; ``benchmarks/baselines/bench_linear_stream_h200_session13.log``): 128-row blocks, K in even splits
of at most 2048 columns, 4 warps, 4 stages with one split and 3 with several (other tilings were up to 40% slower on
some shape). The output projections gain most: [4096, 8192] 22.0 -> 19.1 us at M = 1 (3.5 TB/s), 22.0 -> 20.2 at M =
8, [5120, 8192] 26.1 -> 23.4 / 26.9 -> 24.6 us; the q up-projections [32768, 1024 / 1280] and V4.1's Engram values
[25600, 6144] 2-4% (cuBLAS streams them at 87-95% of copy already). Weights under 32 MB stay on cuBLAS: the [4096 /
5120, 2048 / 2304] shared-expert down projections were 3-10% slower here. The exception: short streams from a
q_lora-rank input (``SHORT_STREAM_*``, the index query up-projections), faster as one 64-row block over all of K a
program. V4's grouped ``wo_a`` (8 x [1024, 4096]) as one stream matched cuBLAS's batched GEMM (18.4-19.0 against 18.8
us) and stays there.

Deterministic (fixed split and summation order for a given shape) but not batch-invariant: a row's bits change
when the batch crosses ``SKINNY_MAX_ROWS`` (cuBLAS above it); batch-invariant mode keeps ``triton_fixed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import (
    COUNTERS,
    counter_block,
    interpreting,
    pdl_options,
    triton_cuda_available,
)
from deepinfer_kernels.registry import register_backend

from .cublas import linear_cublas

SKINNY_MAX_ROWS = 8  # rows of x (one 16-row tensor-core tile); more go to cuBLAS
SKINNY_MAX_N = 1280  # weight rows served at up to SKINNY_MAX_ROWS rows (32-column blocks)
SKINNY_WIDE_N, SKINNY_WIDE_ROWS = 2304, 2  # and wider weights up to these at batch 1-2 (64-column blocks)
BLOCK_M, BLOCK_K, K_SPLIT = 16, 128, 512
NARROW_WARPS, NARROW_STAGES = 4, 4  # of narrow_tiling (module globals, read per call: benchmarks' --set reaches them)
# weight streams: wider weights of at least STREAM_MIN_ELEMS elements (32 MB in bf16: the q up-projections, output
# projections and V4.1's Engram values, 67-315 MB) in STREAM_BLOCK_N-row blocks and K splits of up to STREAM_K_SPLIT
STREAM_MIN_N, STREAM_MIN_ELEMS = SKINNY_WIDE_N + 1, 1 << 24
STREAM_BLOCK_N, STREAM_K_SPLIT = 128, 2048
# short streams: the index query up-projections ([8192, 1024] for V4, [4096, 1280] for V4.1: 10-16 MB of weight from
# a q_lora-rank input) in 64-row blocks over all of K, one program each. cuBLAS: 7.07 / 5.82 us; these: 6.27 / 5.70
# (session 13's ``bench_linear.py --stream`` sweep), and in a step they launch early (programmatic dependent launch)
SHORT_STREAM_MAX_K, SHORT_STREAM_MIN_ELEMS = 1280, 1 << 22


@triton.jit
def skinny_tile(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, tile, pid_k, M, N, K, K_SPLIT, SPLIT, WS_N, ws_col, m0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Rows [m0, m0 + BLOCK_M) of column block ``tile`` of out = x w^T ([M, K] x [N, K]^T, both contiguous), K
    split ``pid_k``: partials go to columns ``ws_col`` + of the fp32 workspace [SPLIT, M, WS_N]; ``cnt_ptr`` is this
    (row, column) block's arrival counter (several weights can share one workspace and counter set:
    ``linear_many``)."""
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = (tile * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < k_hi
        a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if F32_DOT:  # the CPU interpreter, whose bf16 dot is wrong (fp32 products of bf16 values are exact)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = ws_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * WS_N + ws_col + rn[None, :]
        tl.store(part, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the one release below
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last of the column block: add the partials in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                p = ws_ptr + (s * M + rm[:, None]).to(tl.int64) * WS_N + ws_col + rn[None, :]
                total += tl.load(p, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT, SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    skinny_tile(
        x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr + pid_n, pid_n, tl.program_id(1), M, N, K, K_SPLIT, SPLIT, N, 0, 0,
        BLOCK_M, BLOCK_N, BLOCK_K, F32_DOT,
    )  # fmt: skip


@dataclass(frozen=True)
class Tiling:
    """How one launch cuts an [N, K] weight: programs of ``block_n`` weight rows x ``k_split`` columns (``split``
    of them along K, the last one ragged), K walked in ``block_k`` steps; ``warps`` / ``stages`` of the launch;
    ``block_m`` rows of x a program takes (``linear`` one tile of BLOCK_M, ``linear_many`` up to 128)."""

    block_n: int
    block_k: int
    k_split: int
    split: int
    warps: int = 4
    stages: int = 4
    block_m: int = BLOCK_M


def even_k_split(k: int, most: int, block_k: int) -> tuple[int, int]:
    """(columns per split, splits): K cut into the fewest splits of at most ``most`` columns, made even over whole
    ``block_k`` steps (the last one ragged)."""
    k_split = triton.cdiv(triton.cdiv(k, triton.cdiv(k, most)), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def narrow_tiling(k: int, block_n: int) -> Tiling:
    """A narrow weight at up to SKINNY_MAX_ROWS rows of x: ``block_n``-row blocks, K in splits of at most
    ``K_SPLIT`` columns (latency-bound: many short programs)."""
    k_split = min(K_SPLIT, triton.cdiv(k, BLOCK_K) * BLOCK_K)
    return Tiling(block_n, BLOCK_K, k_split, triton.cdiv(k, k_split), NARROW_WARPS, NARROW_STAGES)


def skinny_config(n: int, k: int) -> Tiling:
    """The tiling of an [n, k] weight: narrow weights (up to ``SKINNY_WIDE_N`` rows) in 32-column blocks (64 past
    ``SKINNY_MAX_N``) and 512-column K splits, latency-bound; wider ones as a weight stream (``STREAM_*``)."""
    if n > SKINNY_WIDE_N and k <= SHORT_STREAM_MAX_K and n * k < STREAM_MIN_ELEMS:  # a short stream (``serves``)
        k_split = triton.cdiv(k, BLOCK_K) * BLOCK_K
        return Tiling(64, BLOCK_K, k_split, 1, 4, 4)
    if n > SKINNY_WIDE_N:
        k_split, split = even_k_split(k, STREAM_K_SPLIT, BLOCK_K)
        return Tiling(STREAM_BLOCK_N, BLOCK_K, k_split, split, 4, 4 if split == 1 else 3)
    return narrow_tiling(k, 32 if n <= SKINNY_MAX_N else 64)


def serves(m: int, n: int, k: int | None = None) -> bool:
    """Whether ``linear_skinny`` takes an [m, k] x [n, k]^T product itself (bf16 / fp16), not cuBLAS: narrow
    weights at up to ``SKINNY_MAX_ROWS`` rows (up to ``SKINNY_WIDE_N`` at ``SKINNY_WIDE_ROWS``), and weights of at
    least ``STREAM_MIN_N`` rows and ``STREAM_MIN_ELEMS`` elements (k unknown: not) at up to SKINNY_MAX_ROWS."""
    if not 0 < m <= SKINNY_MAX_ROWS:
        return False
    if n <= SKINNY_MAX_N or (n <= SKINNY_WIDE_N and m <= SKINNY_WIDE_ROWS):
        return True
    if k is not None and n >= STREAM_MIN_N and k <= SHORT_STREAM_MAX_K and n * k >= SHORT_STREAM_MIN_ELEMS:
        return True
    return k is not None and n >= STREAM_MIN_N and n * k >= STREAM_MIN_ELEMS


def linear_skinny(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, cfg: Tiling | None = None
) -> torch.Tensor:
    """``linear`` for <= ``SKINNY_MAX_ROWS`` rows of bf16 / fp16 x with a weight of x's dtype (see the module
    docstring); cuBLAS otherwise. ``cfg`` overrides the tiling (benchmarks; then any weight width is served)."""
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    a = x.reshape(-1, k)
    m = a.shape[0]
    if (
        n == 0 or k == 0 or not (serves(m, n, k) or (cfg is not None and 0 < m <= SKINNY_MAX_ROWS))
        or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype
    ):  # fmt: skip
        return linear_cublas(x, weight, out_dtype)
    t = cfg or skinny_config(n, k)
    if triton.cdiv(n, t.block_n) > COUNTERS:
        return linear_cublas(x, weight, out_dtype)
    a = a.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    ws = torch.empty(t.split, m, n, dtype=torch.float32, device=x.device) if t.split > 1 else out
    _skinny_kernel[(triton.cdiv(n, t.block_n), t.split)](
        a, weight.contiguous(), out, ws, counter_block(x.device), m, n, k, t.k_split, t.split,
        BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, F32_DOT=interpreting(),
        num_warps=t.warps, num_stages=t.stages, **pdl_options(a.device),
    )  # fmt: skip
    return out.reshape(*lead, n)


register_backend(
    "linear", "triton_skinny", linear_skinny, devices=("cuda",), priority=30, available=triton_cuda_available,
    batch_invariant=False,
)  # fmt: skip

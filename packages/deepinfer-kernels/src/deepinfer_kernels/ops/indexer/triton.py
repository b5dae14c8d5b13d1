"""Triton lightning indexer (``triton`` backends of ``indexer_scores``, ``indexer_scores_paged``, ``indexer_topk``).

I[b, s, n] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, n]) * softmax_scale (contract in ``__init__.py``).

Grid (ceil(S / BLOCK_S), ceil(N / SPAN), B). A program stacks the H heads of BLOCK_S queries into one
[BLOCK_S * H, Dh] operand, loaded once, and walks its SPAN keys in [BLOCK_N, Dh] tiles: each tile is one
tensor-core dot (fp32 accumulation; fp32 inputs use exact-fp32 "ieee" dots), then ReLU, the scale and the head
weights in the reference's order, and one tl.sum over the H heads of each query. SPAN is one tile while the query
blocks alone cannot fill the GPU (decode), eight in prefill; with ``visible`` a program stops at the last key its
queries see and writes -inf past it (a causal prefill computes half the scores). A score is one dot whatever SPAN
is, so its bits depend only on its query and key, not on S or N: the backend is batch-invariant (and invariant in
N, which grows during decode). H and Dh must be powers of two (V4: 64 x 128, V4.1: 32 x 128); other shapes fall
back to the reference.

One query per request (S = 1: every decode step) stacks DECODE_ROWS = 64 rows instead of ROWS = 128: 128 rows of
V4.1's 32 heads are one live query and three masked ones, so three quarters of each dot, of the head sums and of
the registers were padding. 64 rows keep the dot a Hopper wgmma of the same K steps, so a score's bits are those of
the 128-row tile (the GPU tests compare a query alone with the same query inside S = 64 and S = 2048, bitwise);
V4.1's 32 rows alone would be 20% faster again but compile to mma.sync, whose bits differ.

``indexer_scores_paged`` is the same kernel reading each key row through the request's block table (the tile
arithmetic is unchanged: bitwise the dense op over the gathered keys). ``indexer_topk`` on CUDA is the radix
select of ``topk_select`` (programs per query row, no sort: its output is ascending by construction), which reads
the candidate mask itself (a masked copy of the scores was a PyTorch pass of 38 us over V4.1's [256, 32K] rows). Its
tie rule (lower index wins) is one of the choices ``indexer_topk``'s contract leaves open; exact, hence
batch-invariant. With a ``row_map`` the select's kernels write the attention row table of the picks themselves (a
decode step's ``paged_rows`` launch saved; see ``topk_select/triton.py``).
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import (
    interpreting,
    pdl_options,
    require_same_device,
    sm_count,
    triton_cuda_available,
)
from deepinfer_kernels.registry import register_backend

from ..topk_select.triton import topk_select_triton
from .reference import indexer_scores_paged_ref, indexer_scores_ref

BLOCK_N = 64
ROWS = 128  # BLOCK_S * H: stacked (query, head) rows per program
SPAN_TILES = 8  # key tiles per program in prefill (q loaded once for 512 keys)
# S = 1 (decode): 64 stacked rows (one V4 query, or one V4.1 query and a masked one: wgmma's M is 64), four key
# tiles a program once that still gives every SM a program. H200, CUDA graphs (session 11), one query per request
# against 1-8K paged keys: 1.4-2.2x the 128-row tile from batch 1 to 256 (batch 256, 32 heads: 2048 keys 99.8 ->
# 47.7 us, 4096 keys 192.5 -> 86.8 us, the keys streamed at 2.8-3.1 TB/s).
DECODE_ROWS = 64
DECODE_SPAN_TILES = 4


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, t_ptr, w_ptr, o_ptr, v_ptr, S, N, scale,
    q_sb, q_ss, q_sh, k_sb, k_sn, t_sb, w_sb, w_ss, o_sb, o_ss, v_sb,
    H: tl.constexpr, DH: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, RPB: tl.constexpr, VIS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    b = tl.program_id(2).to(tl.int64)
    s0 = tl.program_id(0) * BLOCK_S
    n_beg = tl.program_id(1) * SPAN
    n_end = tl.minimum(n_beg + SPAN, N)
    r = tl.arange(0, BLOCK_S * H)
    s = s0 + r // H
    h = r % H
    s_ok = s < S
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + b * q_sb + s[:, None].to(tl.int64) * q_ss + h[:, None] * q_sh + d[None, :],
                mask=s_ok[:, None], other=0.0)  # fmt: skip
    w = tl.load(w_ptr + b * w_sb + s.to(tl.int64) * w_ss + h, mask=s_ok, other=0.0)
    so = s0 + tl.arange(0, BLOCK_S)
    so_ok = so < S
    o_rows = o_ptr + b * o_sb + so[:, None].to(tl.int64) * o_ss
    lim = n_end
    if VIS:  # keys at or past a query's visible length are -inf; tiles no query of the block sees are not computed
        vis = tl.minimum(tl.maximum(tl.load(v_ptr + b * v_sb + so, mask=so_ok, other=0), 0), N).to(tl.int32)
        lim = tl.minimum(n_end, tl.max(vis, axis=0))
    for n0 in range(n_beg, lim, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_end
        if RPB:  # paged: key n of request b is row n % RPB of block tables[b, n // RPB] of the pool
            blk = tl.load(t_ptr + b * t_sb + n // RPB, mask=n_ok, other=0)
            k_off = (blk * RPB + n % RPB).to(tl.int64) * k_sn
        else:
            k_off = b * k_sb + n.to(tl.int64) * k_sn
        kt = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
        if UPCAST:  # interpreter only: its bf16 dot is wrong; fp32 dots of bf16 values are exact products
            logits = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)  # [BLOCK_S * H, BLOCK_N] fp32
        logits = (tl.maximum(logits, 0.0) * scale) * w[:, None]  # the reference's order
        out = tl.sum(tl.reshape(logits, [BLOCK_S, H, BLOCK_N]), axis=1)
        if VIS:
            out = tl.where(n[None, :] < vis[:, None], out, float("-inf"))
        tl.store(o_rows + n[None, :], out, mask=so_ok[:, None] & n_ok[None, :])
    if VIS:
        first = n_beg + tl.cdiv(tl.maximum(lim - n_beg, 0), BLOCK_N) * BLOCK_N
        for n0 in range(first, n_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            tl.store(o_rows + n[None, :], tl.full([BLOCK_S, BLOCK_N], float("-inf"), tl.float32),
                     mask=so_ok[:, None] & (n < n_end)[None, :])  # fmt: skip


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _launch(q, k, tables, rpb: int, weights, softmax_scale: float, n: int, visible=None) -> torch.Tensor:
    """Both ops' launch: k [B, N, Dh] (``tables`` None, ``rpb`` 0) or a pool [blocks, rpb, Dh] read through
    ``tables`` [B, nblk] (N = nblk * rpb). ``visible`` [B, S] int64 or None (see ``indexer_scores``)."""
    b, s, h, dh = q.shape
    require_same_device(q, k, weights, *([tables] if tables is not None else []))
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.dtype != k.dtype:  # one dot dtype: the wider of the two (fp32 upcasts are exact)
        q, k = q.float(), k.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 and (tables is None or k.stride(0) == rpb * k.stride(1)) else k.contiguous()
    weights = weights.contiguous()
    t = tables.contiguous() if tables is not None else weights  # dummy pointer when dense
    vis = visible.to(device=q.device, dtype=torch.int64).contiguous() if visible is not None else weights
    k_sb, k_sn = (0, k.stride(1)) if tables is not None else (k.stride(0), k.stride(1))
    sms = sm_count(q.device)
    # keys per program: one tile while the query blocks alone leave SMs idle, else SPAN_TILES tiles (S = 1: four
    # while that still gives every SM a program), so a program's queries are loaded once for many keys. A score's
    # arithmetic does not depend on it (one dot per tile)
    if s == 1:
        block_s = max(1, DECODE_ROWS // h)
        wide = b * triton.cdiv(n, BLOCK_N * DECODE_SPAN_TILES) >= sms
        span = BLOCK_N * (DECODE_SPAN_TILES if wide else 1)
    else:
        block_s = max(1, ROWS // h)
        span = BLOCK_N * (SPAN_TILES if triton.cdiv(s, block_s) * b >= 2 * sms else 1)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    grid = (triton.cdiv(s, block_s), triton.cdiv(n, span), b)
    _indexer_scores_kernel[grid](
        q, k, t, weights, out, vis, s, n, float(softmax_scale),
        q.stride(0), q.stride(1), q.stride(2), k_sb, k_sn, t.stride(0), weights.stride(0), weights.stride(1),
        out.stride(0), out.stride(1), vis.stride(0),
        H=h, DH=dh, BLOCK_S=block_s, BLOCK_N=BLOCK_N, SPAN=span, DOT_PREC=prec,
        UPCAST=interpreting() and prec != "ieee", RPB=rpb, VIS=visible is not None,
        num_warps=8 if q.dtype == torch.float32 else 4, num_stages=2, **pdl_options(q.device),
    )  # fmt: skip
    return out


def _supported(q: torch.Tensor) -> bool:
    h, dh = q.shape[2], q.shape[3]
    return _pow2(h) and _pow2(dh) and dh >= 16 and h <= ROWS


def indexer_scores_triton(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None = None
) -> torch.Tensor:
    if not _supported(q):
        return indexer_scores_ref(q, k, weights, softmax_scale, visible)
    return _launch(q, k, None, 0, weights, softmax_scale, k.shape[1], visible)


def indexer_scores_paged_triton(
    q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    if not _supported(q):
        return indexer_scores_paged_ref(q, pool, tables, weights, softmax_scale)
    rpb = pool.shape[1]
    return _launch(q, pool, tables, rpb, weights, softmax_scale, tables.shape[1] * rpb)


register_backend(
    "indexer_scores", "triton", indexer_scores_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
register_backend(
    "indexer_scores_paged", "triton", indexer_scores_paged_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip


def indexer_topk_triton(
    scores: torch.Tensor, visible: torch.Tensor, top_k: int, mask: torch.Tensor | None = None, row_map=None
) -> torch.Tensor:
    """The op (contract in ``__init__.py``); with ``row_map`` the select's kernels write the row table themselves."""
    b, s, n = scores.shape
    flat_mask = mask.reshape(b * s, n) if mask is not None else None  # read by the select: no masked copy of scores
    flat_visible = visible.reshape(b * s).to(torch.int64)
    picks = topk_select_triton(scores.reshape(b * s, n), top_k, flat_visible, flat_mask, row_map=row_map)
    return picks.view(b, s, picks.shape[1])  # (not -1: a width of 0 leaves it undefined)


register_backend(
    "indexer_topk", "triton", indexer_topk_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

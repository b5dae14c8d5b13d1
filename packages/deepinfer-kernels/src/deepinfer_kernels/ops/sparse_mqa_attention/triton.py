"""Triton sparse MQA attention with sinks (CUDA backends ``triton`` and ``triton_adaptive``).

Serves ``sparse_mqa_attention`` (contract in ``__init__.py``) for decode and prefill alike: every
query row gathers its own K = V rows of the shared pool ``kv`` [N, D] through ``indices`` [T, K]
(flat slots, -1 = padding, int64 or int32), so the op already is the paged-decode interface
(pool + per-row slot list; FlashMLA's ``indices`` are the same flat physical slots). ``kv`` may be two
segments read in place (a decode step's window rows and the paged pool of compressed entries): slot
i < N_0 is row i of the first, slot N_0 + j row j of the second.

Kernel ``_attn_partial``: grid (T, ceil(H / BLOCK_H), n_splits). A program loads its BLOCK_H query
heads [BLOCK_H, D] once, walks its split of the index list in BLOCK_N tiles (gather the rows,
S = Q K^T on tensor cores, fp32 online softmax, O += P V), and either finishes the row itself (one
split: adds the sink, normalises, writes q.dtype) or writes the unnormalised fp32 partial
(acc [D], running max m, running sum l) per (token, head, split) for ``_attn_combine``, which folds
the splits in split order and adds the sink.

With ``out_rope`` (positions, inv_freq) the kernel that stores a row (``_attn_partial`` with one split,
``_attn_combine`` otherwise) rounds it to the output dtype, rotates back its trailing R channels as
``rope_interleaved(inverse=True)`` would (``rope.triton.rope_tail_rows``: the same angle, libdevice cos / sin and
products rounded one by one, compiled without flush-to-zero) and stores that: the bits of the RoPE kernel run on
the output, without its launch.

Invariance: a row's arithmetic depends only on its own q / index list, the split size and the tile
constants, never on T. Backend ``triton`` (batch_invariant=True) always splits the list every
``INVARIANT_SPLIT`` entries. Backend ``triton_adaptive`` (faster, not invariant) splits only when
T alone cannot fill the GPU. P is rounded to the KV dtype for the P V product (bf16 on the real
model), as in FlashAttention; accuracy vs the fp32 reference is ~1e-3 relative for bf16.
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
from deepinfer_kernels.ops.rope.triton import rope_tail_rows
from deepinfer_kernels.registry import register_backend

INVARIANT_SPLIT = 256  # entries per split of the invariant backend (V4.1: 640 entries -> 3 splits)
PARTIAL_BYTES = 256 << 20  # cap on the fp32 partial buffers; longer prefills run in row chunks
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: keeps exp(m_old - m_new) NaN-free


@triton.jit
def _attn_partial(
    q_ptr, kv_ptr, kv2_ptr, idx_ptr, sink_ptr, o_ptr, acc_ptr, ml_ptr, pos_ptr, freq_ptr,
    H, D, K, N1, n_splits, scale, HALF,
    q_st, q_sh, kv_s, kv2_s, idx_st, o_st, o_sh,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FINAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, TWO: tl.constexpr, ROPE: tl.constexpr,
    LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    sp = tl.program_id(2)
    h_ok = heads < H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + t * q_st + heads[:, None] * q_sh + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, K)
    for j in range(lo, hi, BLOCK_N):
        n = j + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_ptr + t * idx_st + n, mask=n < hi, other=-1).to(tl.int64)
        ok = slot >= 0
        if TWO:  # rows past the first segment's N1 are rows of the second
            first = slot < N1
            rows = tl.where(first, kv_ptr + slot * kv_s, kv2_ptr + (slot - N1) * kv2_s)
            kt = tl.load(rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        else:
            kt = tl.load(kv_ptr + slot[:, None] * kv_s + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # interpreter only: its bf16 dot is wrong; fp32 dots of bf16 values are exact products
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * scale  # [BLOCK_H, BLOCK_N] fp32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p.to(kt.dtype).to(tl.float32), kt.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(kt.dtype), kt, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if FINAL:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
        top = tl.maximum(m, sink)
        a = tl.exp(m - top)
        o = (acc * (a / (l * a + tl.exp(sink - top)))[:, None]).to(o_ptr.dtype.element_ty)
        if ROPE:  # the stored rows, inverse-rotated as rope_interleaved would rotate them
            pos = tl.load(pos_ptr + t)
            o = rope_tail_rows(o.to(tl.float32), pos, freq_ptr, D, HALF, True, LIBDEVICE, BLOCK_H, BLOCK_D)
        tl.store(
            o_ptr + t * o_st + heads[:, None] * o_sh + d[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=h_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (t * H + heads) * n_splits + sp  # [BLOCK_H] partial row ids
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + part * 2, m, mask=h_ok)
        tl.store(ml_ptr + part * 2 + 1, l, mask=h_ok)


@triton.jit
def _attn_combine(
    acc_ptr, ml_ptr, sink_ptr, o_ptr, pos_ptr, freq_ptr, H, D, n_splits, o_st, o_sh, HALF, BLOCK_D: tl.constexpr,
    ROPE: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False
):  # fmt: skip
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    base = (t * H + h) * n_splits
    sink = tl.load(sink_ptr + h).to(tl.float32)
    top = sink
    for sp in range(0, n_splits):
        top = tl.maximum(top, tl.load(ml_ptr + (base + sp) * 2))
    denom = tl.exp(sink - top)
    o = tl.zeros([BLOCK_D], tl.float32)
    for sp in range(0, n_splits):  # fixed split order: the sum's bits depend on the row alone
        w = tl.exp(tl.load(ml_ptr + (base + sp) * 2) - top)
        denom += tl.load(ml_ptr + (base + sp) * 2 + 1) * w
        o += tl.load(acc_ptr + (base + sp) * D + d, mask=d_ok, other=0.0) * w
    o = (o / denom).to(o_ptr.dtype.element_ty)
    if ROPE:  # the stored row, inverse-rotated as rope_interleaved would rotate it
        pos = tl.load(pos_ptr + t)
        o = tl.reshape(
            rope_tail_rows(o.to(tl.float32)[None, :], pos, freq_ptr, D, HALF, True, LIBDEVICE, 1, BLOCK_D), [BLOCK_D]
        )
    tl.store(o_ptr + t * o_st + h * o_sh + d, o.to(o_ptr.dtype.element_ty), mask=d_ok)


def prepare_call(q: torch.Tensor, kv, indices: torch.Tensor, sinks: torch.Tensor) -> tuple:
    """What every launcher does first: (q, segments, indices, sinks, out, done). The segments are at most two (the
    kernels read two in place; more are concatenated), rows unit-stride, sinks fp32, out [T, H, D] in q.dtype;
    ``done``: out already is the result (no rows, heads or columns: empty; no entries: zeros)."""
    segments = list(kv) if isinstance(kv, (tuple, list)) else [kv]
    if len(segments) > 2:
        segments = [segments[0], torch.cat(segments[1:])]
    require_same_device(q, *segments, indices, sinks)
    t, h, d = q.shape
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0 or h == 0 or d == 0:
        return q, segments, indices, sinks, out, True
    if indices.shape[1] == 0:
        return q, segments, indices, sinks, out.zero_(), True
    q = q if q.stride(-1) == 1 else q.contiguous()
    segments = [s if s.stride(-1) == 1 else s.contiguous() for s in segments]
    return q, segments, indices.contiguous(), sinks.float().contiguous(), out, False


def launch(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float, *,
    split: int | None, block_h: int = 32, block_n: int = 32, num_warps: int = 8, num_stages: int = 2,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Run the kernels. ``split``: entries per split (a multiple of ``block_n``), or None for one pass
    per row. The tile arguments are exposed for the benchmark's sweep; the backends fix them. ``out_rope``
    (positions [T], inv_freq [R/2]): the output rows inverse-rotated in the kernel that stores them (the op's
    contract)."""
    q, segments, indices, sinks, out, done = prepare_call(q, kv, indices, sinks)
    if done:  # empty, or zeros (which rotate to zeros)
        return out
    t, h, d = q.shape
    k = indices.shape[1]
    block_h = max(16, min(block_h, triton.next_power_of_2(h)))  # tl.dot needs M >= 16 (padded heads)
    block_d = triton.next_power_of_2(d)
    prec = "ieee" if q.dtype == torch.float32 or segments[0].dtype == torch.float32 else "tf32"  # tf32: not for bf16
    segments = [s.to(q.dtype) if s.dtype != q.dtype else s for s in segments]
    kv, kv2 = segments[0], segments[-1]
    if split is not None and split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    n_splits = 1 if split is None else triton.cdiv(k, split)
    span = k if split is None else split
    span = triton.cdiv(span, block_n) * block_n
    final = split is None
    rows = t if final else max(1, min(t, PARTIAL_BYTES // (h * n_splits * d * 4)))
    acc = ml = out  # dummies for the single-pass launch
    if not final:
        acc = torch.empty(rows, h, n_splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(rows, h, n_splits, 2, dtype=torch.float32, device=q.device)
    pos = freq = sinks  # dummies without out_rope
    half = 0
    if out_rope is not None:
        pos, freq = out_rope[0].contiguous(), out_rope[1].to(device=q.device, dtype=torch.float32).contiguous()
        half = freq.shape[0]
    # libdevice's non-flush-to-zero cos / sin / rn ops, as the RoPE kernel compiles them (only RoPE calls libdevice)
    rope = dict(ROPE=half > 0, LIBDEVICE=not interpreting(), **({"enable_reflect_ftz": False} if half else {}))
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        qc, ic, oc, pc = q[r0:r1], indices[r0:r1], out[r0:r1], pos[r0:r1] if half else pos
        grid = (r1 - r0, triton.cdiv(h, block_h), n_splits)
        _attn_partial[grid](
            qc, kv, kv2, ic, sinks, oc, acc, ml, pc, freq, h, d, k, kv.shape[0], n_splits, float(scale), half,
            qc.stride(0), qc.stride(1), kv.stride(0), kv2.stride(0), ic.stride(0), oc.stride(0), oc.stride(1),
            SPLIT=span, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, FINAL=final, DOT_PREC=prec,
            UPCAST=interpreting() and prec != "ieee", TWO=len(segments) == 2, **rope,
            num_warps=num_warps, num_stages=num_stages, **pdl_options(qc.device),
        )  # fmt: skip
        if not final:
            _attn_combine[(r1 - r0, h)](
                acc, ml, sinks, oc, pc, freq, h, d, n_splits, oc.stride(0), oc.stride(1), half, BLOCK_D=block_d,
                **rope, num_warps=4, **pdl_options(acc.device),
            )  # fmt: skip
    return out


# Tile configs (block_h, block_n, num_warps, num_stages), from the H200 sweeps in bench_sparse_mqa_attention.py
# (V4.1 shapes: 64 heads of 512, 640 entries per query).
INVARIANT_TILE = (32, 64, 8, 2)  # one config for every T: the tiles shape a row's arithmetic
DECODE_TILE = (32, 64, 8, 2)
# 64 heads per program (each gathered row is read once per query) once the rows alone fill the SMs, 64 rows a step
# in one stage: prefill 8K 3.29 ms (3.98 with 32 rows in 2 stages, 4.37 in 1), decode batch 256 142 us (158, and
# 201 with DECODE_TILE); batch 64 keeps DECODE_TILE (58 us against 82). H200 sweeps, sessions 6 and 7.
WIDE_TILE = (64, 64, 8, 1)


def _run(q, kv, indices, sinks, scale, split, tile, out_rope=None):
    block_h, block_n, warps, stages = tile
    return launch(
        q, kv, indices, sinks, scale, split=split, block_h=block_h, block_n=block_n, num_warps=warps,
        num_stages=stages, out_rope=out_rope,
    )  # fmt: skip


def sparse_mqa_attention_triton(q, kv, indices, sinks, scale, out_rope=None):
    """Batch-invariant: always the same split of the index list and the same tiles, whatever T is."""
    return _run(q, kv, indices, sinks, scale, INVARIANT_SPLIT, INVARIANT_TILE, out_rope)


# Small decode batches: the rows alone leave most SMs idle, so the index list is split finer and fewer heads share a
# program. Of the (heads per program, entries per split) pairs below, the one with the most work per program that
# still gives DECODE_PROGRAMS programs (fewest work if none does; ties: more heads, fewer re-gathers of a row). H200
# sweep (session 8, 64 heads of 512, 160 / 640 entries, batch 1-32): 16.9 -> 7.8 us at batch 1 x 160 entries,
# 21.7 -> 9.2 us at 1 x 640, 22.9 -> 15.6 us at 8 x 640, 36.4 -> 29.3 us at 32 x 640 (against the invariant split).
DECODE_HEADS = (16, 32, 64)
DECODE_SPLITS = (64, 128, 256, None)
DECODE_PROGRAMS = 80


def decode_tile(t: int, h: int, k: int) -> tuple[int | None, tuple[int, int, int, int]]:
    """(entries per split or None, (block_h, block_n, warps, stages)) for ``t`` rows of ``h`` heads and ``k``
    entries when they cannot fill the GPU (see DECODE_PROGRAMS)."""
    best, fallback = None, None
    for bh in DECODE_HEADS:
        for split in DECODE_SPLITS:
            if split is not None and split >= k:
                continue
            span = k if split is None else split
            programs = t * triton.cdiv(h, bh) * (1 if split is None else triton.cdiv(k, split))
            key = (bh * triton.cdiv(span, 64), bh)  # work per program (64-entry tiles x heads), then heads
            if fallback is None or key < fallback[0]:
                fallback = (key, bh, split)
            if programs >= DECODE_PROGRAMS and (best is None or key > best[0]):
                best = (key, bh, split)
    _, bh, split = best or fallback
    return split, (bh, 64, 8 if bh >= 64 else 4, 1)


def sparse_mqa_attention_triton_adaptive(q, kv, indices, sinks, scale, out_rope=None):
    """Finer splits and fewer heads a program while the rows leave most SMs idle (small decode batches,
    ``decode_tile``); one pass per row from about batch 64; all heads in one program once the rows fill the SMs
    (prefill, large decode batches). Not batch-invariant: a row's bits depend on T through these choices."""
    t, h = q.shape[0], q.shape[1]
    sms = sm_count(q.device)
    if t >= sms:
        return _run(q, kv, indices, sinks, scale, None, WIDE_TILE, out_rope)
    if 2 * t * triton.cdiv(h, DECODE_TILE[0]) >= sms:  # H200 sweep: one pass wins from about batch 64
        return _run(q, kv, indices, sinks, scale, None, DECODE_TILE, out_rope)
    split, tile = decode_tile(t, h, indices.shape[1])
    return _run(q, kv, indices, sinks, scale, split, tile, out_rope)


# both take ``out_rope`` (the op's front end passes it to a backend that has this attribute, else rotates after it;
# the Gluon backend has it too, through these)
sparse_mqa_attention_triton.fuses_out_rope = True
sparse_mqa_attention_triton_adaptive.fuses_out_rope = True


register_backend(
    "sparse_mqa_attention", "triton", sparse_mqa_attention_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip
register_backend(
    "sparse_mqa_attention", "triton_adaptive", sparse_mqa_attention_triton_adaptive, devices=("cuda",),
    priority=30, available=triton_cuda_available, batch_invariant=False,
)  # fmt: skip

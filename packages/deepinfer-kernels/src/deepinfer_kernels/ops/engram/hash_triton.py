"""Triton ``engram_hash_ids`` (CUDA backend ``triton``): every row id of one Engram layer in one launch.

The reference builds the rolling hash with a dozen int64 torch ops per n-gram order (about 40 small kernels per
Engram layer and decode step, 40-50 us on an H200 at batch 1). Here one program takes BLOCK_T positions and all
H x n_heads columns: it walks the lookback (s = 0..H, constexpr), reads the token s back from the chunk or the
history, blocks from the first DEAD / before-start slot on, XORs v * M[s] into g, and for s >= 1 keeps g for the
n_heads columns of that order; each column is then written as its g mod P[c] plus the exclusive prefix sum of P
(computed in the program). Integer arithmetic: bit-identical to the reference, and a position depends on its own
tokens only (batch-invariant).
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import engram_hash_ids_ref

BLOCK_T = 64  # positions per program (fewer for fewer positions: ``block_t``)


@triton.jit
def _hash_kernel(
    comp_ptr, hist_ptr, mult_ptr, primes_ptr, out_ptr, S, total, pad_id,
    LOOKBACK: tl.constexpr, HEADS: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, HAS_HIST: tl.constexpr,
    BLOCK_T: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # flat position b * S + s
    ok = i < total
    b = i // S
    s = i % S
    c = tl.arange(0, CP)
    c_ok = c < C
    p = tl.load(primes_ptr + c, mask=c_ok, other=1)
    off = tl.cumsum(p, 0) - p  # exclusive prefix sum: the columns' ids never collide
    g = tl.zeros([BLOCK_T], dtype=tl.int64)
    blocked = s < 0  # all False
    hashes = tl.zeros([BLOCK_T, CP], dtype=tl.int64)  # each column's order's hash, reduced once at the end
    for step in tl.static_range(LOOKBACK + 1):
        j = s - step  # the token `step` back: in the chunk (j >= 0) or in the history (j < 0)
        tok = tl.load(comp_ptr + b * S + j, mask=ok & (j >= 0), other=-1)
        if HAS_HIST:
            h = tl.load(hist_ptr + b * LOOKBACK + LOOKBACK + j, mask=ok & (j < 0), other=-1)
            tok = tl.where(j >= 0, tok, h)
        blocked = blocked | (tok < 0)  # before the start, or DEAD: pad from here on
        v = tl.where(blocked, pad_id, tok)
        g = g ^ (v * tl.load(mult_ptr + step))
        if step >= 1:
            mine = (c >= (step - 1) * HEADS) & (c < step * HEADS)
            hashes = tl.where(mine[None, :], g[:, None], hashes)
    out = hashes % p[None, :] + off[None, :]  # one int64 modulo per column (slow: emulated), not one per order
    tl.store(out_ptr + i[:, None] * C + c[None, :], out, mask=ok[:, None] & c_ok[None, :])


def block_t(positions: int) -> int:
    """Positions per program: BLOCK_T, or the next power of two of fewer positions (at least 16). Every lane of a
    program computes its (emulated, slow) int64 modulos whether it holds a position or not: with 64 lanes for one
    position the kernel took 13 us of session 14's V4.1 batch-1 step (not re-timed since). Integer arithmetic: the
    ids do not depend on the tiling."""
    return max(16, min(BLOCK_T, triton.next_power_of_2(positions)))


def engram_hash_ids_triton(compressed, history, multipliers, primes, pad_id: int) -> torch.Tensor:
    """``engram_hash_ids`` in one launch; the reference for tables on another device than ``compressed``."""
    dev = compressed.device
    if any(t is not None and t.device != dev for t in (history, multipliers, primes)):
        return engram_hash_ids_ref(compressed, history, multipliers, primes, pad_id)
    batch, seq = compressed.shape
    lookback, cols = multipliers.numel() - 1, primes.numel()
    out = torch.empty(batch, seq, cols, dtype=torch.int64, device=dev)
    if out.numel():
        comp = compressed.to(torch.int64).contiguous()
        hist = history.to(torch.int64).contiguous() if history is not None else comp
        bt = block_t(batch * seq)
        _hash_kernel[(triton.cdiv(batch * seq, bt),)](
            comp, hist, multipliers.to(torch.int64).contiguous(), primes.to(torch.int64).contiguous(), out,
            seq, batch * seq, int(pad_id), LOOKBACK=lookback, HEADS=cols // lookback, C=cols,
            CP=triton.next_power_of_2(cols), HAS_HIST=history is not None, BLOCK_T=bt, num_warps=4,
            **pdl_options(comp.device),
        )  # fmt: skip
    return out


register_backend(
    "engram_hash_ids", "triton", engram_hash_ids_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

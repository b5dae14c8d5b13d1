"""Triton lightning-indexer scores (CUDA backend ``triton`` of ``indexer_scores``).

I[b, s, n] = sum_h w[b, s, h] * relu(q[b, s, h] . k[b, n]) * softmax_scale (contract in ``__init__.py``).

Grid (ceil(S / BLOCK_S), ceil(N / BLOCK_N), B). A program stacks the H heads of BLOCK_S queries into
one [BLOCK_S * H, Dh] operand, multiplies it by a [BLOCK_N, Dh] tile of keys on tensor cores (fp32
accumulation; fp32 inputs use exact-fp32 "ieee" dots), applies ReLU, the scale and the head
weights in the reference's order, and sums the H heads of each query with one tl.sum. The tile
sizes are constants, so a score's bits depend only on its query and key, not on S or N: the backend
is batch-invariant (and invariant in N, which grows during decode). H and Dh must be powers of two
(V4: 64 x 128, V4.1: 32 x 128); other shapes fall back to the reference.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._triton_launch import interpreting, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import indexer_scores_ref

BLOCK_N = 64
ROWS = 128  # BLOCK_S * H: stacked (query, head) rows per program


@triton.jit
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, o_ptr, S, N, scale,
    q_sb, q_ss, q_sh, k_sb, k_sn, w_sb, w_ss, o_sb, o_ss,
    H: tl.constexpr, DH: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(2).to(tl.int64)
    s0 = tl.program_id(0) * BLOCK_S
    n0 = tl.program_id(1) * BLOCK_N
    r = tl.arange(0, BLOCK_S * H)
    s = s0 + r // H
    h = r % H
    s_ok = s < S
    d = tl.arange(0, DH)
    q = tl.load(q_ptr + b * q_sb + s[:, None].to(tl.int64) * q_ss + h[:, None] * q_sh + d[None, :],
                mask=s_ok[:, None], other=0.0)  # fmt: skip
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kt = tl.load(k_ptr + b * k_sb + n[:, None].to(tl.int64) * k_sn + d[None, :], mask=n_ok[:, None], other=0.0)
    if UPCAST:  # interpreter only: its bf16 dot is wrong; fp32 dots of bf16 values are exact products
        logits = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)  # [BLOCK_S * H, BLOCK_N] fp32
    w = tl.load(w_ptr + b * w_sb + s.to(tl.int64) * w_ss + h, mask=s_ok, other=0.0)
    logits = (tl.maximum(logits, 0.0) * scale) * w[:, None]  # the reference's order
    out = tl.sum(tl.reshape(logits, [BLOCK_S, H, BLOCK_N]), axis=1)
    so = s0 + tl.arange(0, BLOCK_S)
    tl.store(o_ptr + b * o_sb + so[:, None].to(tl.int64) * o_ss + n[None, :], out,
             mask=(so < S)[:, None] & n_ok[None, :])  # fmt: skip


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def indexer_scores_triton(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    b, s, h, dh = q.shape
    n = k.shape[1]
    if not (_pow2(h) and _pow2(dh) and dh >= 16 and h <= ROWS):
        return indexer_scores_ref(q, k, weights, softmax_scale)
    require_same_device(q, k, weights)
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.dtype != k.dtype:  # one dot dtype: the wider of the two (fp32 upcasts are exact)
        q, k = q.float(), k.float()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    weights = weights.contiguous()
    block_s = max(1, ROWS // h)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    grid = (triton.cdiv(s, block_s), triton.cdiv(n, BLOCK_N), b)
    _indexer_scores_kernel[grid](
        q, k, weights, out, s, n, float(softmax_scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), weights.stride(0), weights.stride(1),
        out.stride(0), out.stride(1),
        H=h, DH=dh, BLOCK_S=block_s, BLOCK_N=BLOCK_N, DOT_PREC=prec,
        UPCAST=interpreting() and prec != "ieee", num_warps=8 if q.dtype == torch.float32 else 4,
    )  # fmt: skip
    return out


register_backend(
    "indexer_scores", "triton", indexer_scores_triton, devices=("cuda",), priority=20,
    available=triton_cuda_available, batch_invariant=True,
)  # fmt: skip

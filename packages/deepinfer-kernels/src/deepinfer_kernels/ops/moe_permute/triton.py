"""Triton backend of ``moe_unpermute``: one program per (token, column block) adds the token's k rows in slot
order (a fixed order per token: batch-invariant). The compiler may contract the weight multiply and the add
into one FMA, so results can differ from the reference in the last fp32 bit (tests allow that)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.registry import register_backend

from .reference import inverse_order


@triton.jit
def _unpermute_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, D, K_SLOTS, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, K_SLOTS):
        row = tl.load(pos_ptr + t * K_SLOTS + i)
        v = tl.load(y_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K_SLOTS + i).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_unpermute_triton(y, order, num_tokens, weights=None, out_dtype=None):
    p, d = y.shape
    k = p // num_tokens
    out = torch.empty(num_tokens, d, dtype=out_dtype or y.dtype, device=y.device)
    if d == 0:
        return out
    pos = inverse_order(order) if order is not None else torch.arange(p, device=y.device)
    w = weights.contiguous() if weights is not None else y
    block_d = min(1024, triton.next_power_of_2(d))
    _unpermute_kernel[(num_tokens, triton.cdiv(d, block_d))](
        y.contiguous(), pos, w, out, d, k, HAS_W=weights is not None, BLOCK_D=block_d, num_warps=4
    )
    return out


def _cuda_available() -> bool:
    return torch.cuda.is_available()


register_backend(
    "moe_unpermute", "triton", moe_unpermute_triton, devices=("cuda",), priority=20, available=_cuda_available,
    batch_invariant=True,
)  # fmt: skip

"""Triton softmax-gated pooling (CUDA backend ``triton`` of ``kv_compress_pool`` and ``kv_compress_pool_rows``).

One program pools one group's L slots over a block of BC channels: the [BL, BC] tile of scores and latents is
loaded once (fp32), max / exp / sum over the slots with ``tl.max`` / ``tl.sum``, weighted sum divided by the
denominator. BL = next_pow2(L) and BC depend on L alone, and a group never reads another group's rows, so a
group's bits do not depend on the other groups in the call: batch-invariant by construction. The two ops share
the kernel (``GATHER`` switches only the addressing; empty slots are masked there and -inf / 0 in the dense
layout, which contribute the same exact zeros), so a group pooled from ring rows in place equals, bitwise, the
same group pooled from a dense [W, L, C] tensor: a planned decode step and the per-request path agree.

The reduction order differs from the reference's torch softmax: results match it to ~1 ulp of fp32, not bitwise.
The shapes of the models: HCA L = 128, C = 512; CSA L = 8, C = 512 (indexer: 128); V4.1 ratio 2, C = 512.
"""

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

TILE = 4096  # slots x channels per program (fp32 registers: two tiles live at once)


@triton.jit
def _pool_kernel(
    kv_ptr, score_ptr, rows_ptr, out_ptr, L, C, CK, LEAD, OFF_B,
    GATHER: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    g = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BL)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    in_l, in_c = slot < L, ch < C
    if GATHER:
        row = tl.load(rows_ptr + g * L + slot, mask=in_l, other=-1)
        used = row >= 0
        col = tl.where(slot < LEAD, 0, OFF_B)
        offs = (row * CK + col)[:, None] + ch[None, :]
    else:
        used = in_l
        offs = (g * L + slot)[:, None] * C + ch[None, :]
    m = used[:, None] & in_c[None, :]
    s = tl.load(score_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
    top = tl.max(s, axis=0)
    e = tl.where(m, tl.exp(s - top[None, :]), 0.0)
    v = tl.load(kv_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = tl.sum(e * v, axis=0) / tl.sum(e, axis=0)
    tl.store(out_ptr + g * C + ch, out.to(out_ptr.dtype.element_ty), mask=in_c)


def _config(slots: int) -> tuple[int, int]:
    """(BL, BC) from L alone (the invariance argument above depends on this)."""
    bl = triton.next_power_of_2(max(slots, 1))
    return bl, max(16, min(256, TILE // bl))


def _launch(kv, score, rows, out, slots, width, lead, gather: bool) -> torch.Tensor:
    if out.numel():
        bl, bc = _config(slots)
        ck = kv.shape[-1]
        grid = (out.shape[0], triton.cdiv(width, bc))
        _pool_kernel[grid](
            kv, score, rows, out, slots, width, ck, lead, ck - width,
            GATHER=gather, BL=bl, BC=bc, num_warps=4, **pdl_options(kv.device),
        )  # fmt: skip
    return out


def kv_compress_pool_triton(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    require_same_device(kv, score)
    *lead_dims, w, slots, c = kv.shape
    kv2, score2 = kv.reshape(-1, slots, c).contiguous(), score.reshape(-1, slots, c).contiguous()
    out = torch.empty(kv2.shape[0], c, dtype=kv.dtype, device=kv.device)
    _launch(kv2, score2, kv2, out, slots, c, 0, gather=False)  # rows: an unread dummy pointer
    return out.view(*lead_dims, w, c)


def kv_compress_pool_rows_triton(
    kv: torch.Tensor,
    score: torch.Tensor,
    rows: torch.Tensor,
    lead: int,
    width: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    require_same_device(kv, score, rows)
    if kv.stride(-1) != 1 or score.stride() != kv.stride() or kv.stride(0) != kv.shape[1]:
        kv, score = kv.contiguous(), score.contiguous()
    # the store rounds the fp32 pooled value to out_dtype once (round to nearest even, as torch's cast)
    out = torch.empty(rows.shape[0], width, dtype=out_dtype or kv.dtype, device=kv.device)
    return _launch(kv, score, rows.contiguous(), out, rows.shape[1], width, lead, gather=True)


for _name, _fn in (
    ("kv_compress_pool", kv_compress_pool_triton),
    ("kv_compress_pool_rows", kv_compress_pool_rows_triton),
):
    register_backend(
        _name, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )

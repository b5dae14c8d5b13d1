"""Triton backends of ``fp8_block_dequantize`` and ``act_dequant_fp8``: FP8 e4m3 values times their block scales,
one pass (read 1 byte and a scale per block, write the output dtype), where the references build the expanded
scale tensors.

Bit-exact with the references: the e4m3 -> fp32 conversion is exact, the product is the same fp32 multiply, and
the cast to the output dtype rounds to nearest-even as torch's does. UE8M0 bytes decode as the references do (0 ->
2^-127, 255 -> NaN). Used by ``fp8_gemm_nt`` at prefill sizes (``fp8_gemm/dequant_mm.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import act_dequant_fp8_ref, fp8_block_dequantize_ref
from .triton import e8m0_to_f32


@triton.jit
def _dequant_kernel(
    q_ptr, s_ptr, out_ptr, R, K, S_COLS,
    B0: tl.constexpr, B1: tl.constexpr, E8M0: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """out[r, k] = q[r, k] * s[r // B0, k // B1] for a BLOCK_R x BLOCK_K tile; q, out: [R, K] row-major, s: [ceil(R /
    B0), S_COLS]."""
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (r < R)[:, None] & (k < K)[None, :]
    q = tl.load(q_ptr + r[:, None] * K + k[None, :], mask=ok, other=0.0).to(tl.float32)
    s_ptrs = s_ptr + (r // B0)[:, None] * S_COLS + (k // B1)[None, :]
    if E8M0:
        s = e8m0_to_f32(tl.load(s_ptrs, mask=ok, other=127))
    else:
        s = tl.load(s_ptrs, mask=ok, other=1.0)
    tl.store(out_ptr + r[:, None] * K + k[None, :], (q * s).to(out_ptr.dtype.element_ty), mask=ok)


def _dequant(q2: torch.Tensor, scale2: torch.Tensor, b0: int, b1: int, out_dtype: torch.dtype) -> torch.Tensor:
    """[R, K] e4m3 and [ceil(R / b0), ceil(K / b1)] scales -> [R, K] ``out_dtype``."""
    require_same_device(q2, scale2)
    rows, k = q2.shape
    out = torch.empty(rows, k, dtype=out_dtype, device=q2.device)
    if rows == 0 or k == 0:
        return out
    e8m0 = scale2.dtype != torch.float32
    s = scale2.contiguous().view(torch.uint8) if e8m0 else scale2.contiguous()
    block_k = min(256, triton.next_power_of_2(k))
    block_r = max(1, 4096 // block_k)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        q2.contiguous(), s, out, rows, k, s.shape[1], B0=b0, B1=b1, E8M0=e8m0, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=4, **pdl_options(q2.device),
    )  # fmt: skip
    return out


def fp8_block_dequantize_triton(q, scale, block, out_dtype=torch.float32):
    """``fp8_block_dequantize`` in one kernel; float64 output goes to the reference (no fp64 stores here)."""
    if out_dtype == torch.float64:
        return fp8_block_dequantize_ref(q, scale, block, out_dtype)
    return _dequant(q, scale, block[0], block[1], out_dtype)


def act_dequant_fp8_triton(q, scale, block, out_dtype=torch.float32):
    """``act_dequant_fp8`` in one kernel (leading dims flattened); float64 output goes to the reference."""
    if out_dtype == torch.float64:
        return act_dequant_fp8_ref(q, scale, block, out_dtype)
    k = q.shape[-1]
    out = _dequant(q.reshape(-1, k), scale.reshape(-1, scale.shape[-1]), 1, block, out_dtype)
    return out.reshape(q.shape)


for _op, _fn in (("fp8_block_dequantize", fp8_block_dequantize_triton), ("act_dequant_fp8", act_dequant_fp8_triton)):
    # elementwise: rows are independent, so batch-invariant
    register_backend(
        _op, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )

"""Triton backend of ``act_quant_fp8`` (per-token FP8 quantisation of activations, power-of-two scales), and the
UE8M0 scale decode (``e8m0_to_f32``) every kernel reading block-scaled FP8 / MXFP4 weights shares.

Bit-exact with the reference: the scale exponent is read from the fp32 bits of max(amax, 1e-4) * fp32(1/448)
exactly as ``formats.pow2_scale_exponent`` does, and x is multiplied by the exact power of two 2^-e (equal to
the reference's division by 2^e) and rounded to nearest-even e4m3 in fp32 bits before the (then exact) cast. Imported by
``ops/fp8_gemm/__init__.py`` (the consumer of these activations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, sm90_or_newer
from deepinfer_kernels.registry import register_backend

from .reference import act_quant_fp8_ref


@triton.jit
def _exp2_int(e):
    """Exact fp32 2^e for int32 e in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
    bits = tl.where(e > -127, (e + 127) << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(e):
    """fp32 2^(e-127) of UE8M0 bytes (any integer tensor holding 0..255); 0 -> 2^-127, 255 -> NaN."""
    ei = e.to(tl.int32) & 0xFF
    bits = tl.where(ei == 0, 0x400000, ei << 23)  # byte 0 is the fp32 subnormal 2^-127
    bits = tl.where(ei == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2_exponent(amax, floor, inv_max):
    """int32 k = ceil(log2(max(amax, floor) * inv_max)) read from the fp32 bits (the product normal), clamped to
    [-127, 127]: the UE8M0 scale exponent of ``formats.pow2_scale_exponent`` (inv_max = fp32(1/448), fp32(1/6))."""
    bits = (tl.maximum(amax, floor) * inv_max).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _round_e4m3(y):
    """fp32 y (|y| <= 448) rounded to the nearest-even float8_e4m3fn value, still in fp32.

    Done in fp32 bits so the final cast to e4m3 is exact: Triton 3.6's interpreter rounds fp32 -> fp8 wrongly
    where the mantissa carries into the exponent (125 -> 64), and exact inputs make the cast's rounding moot.
    """
    bits = y.to(tl.int32, bitcast=True)
    # normal e4m3 (|y| >= 2^-6): keep 3 of the 23 mantissa bits, ties to even; a carry bumps the exponent
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal e4m3 (|y| < 2^-6): multiples of 2^-9, ties to even
    m = tl.abs(y) * 512.0
    f = tl.floor(m)
    frac = m - f
    odd = (f.to(tl.int32) & 1) == 1
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f) * (1.0 / 512.0)
    # copy the sign bit (Triton's unary minus is 0 - r, which would turn -0.0 into +0.0)
    sub = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) >= 0.015625, normal, sub)


@triton.jit
def _row_blocks(x_ptr, K, G, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    """This program's GROUPS blocks of BLOCK values (blocks program_id(1) * GROUPS .. of row program_id(0) of the
    row-major [rows, K] input, G blocks a row, the last one possibly partial): (row, block ids, offsets in the row,
    mask, fp32 values, per-block max |x|)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = (g[:, None] < G) & (k < K)
    x = tl.load(x_ptr + row * K + k, mask=ok, other=0.0).to(tl.float32)
    return row, g, k, ok, x, tl.max(tl.abs(x), axis=1)


def tiled_block(x: torch.Tensor, block: int) -> bool:
    """Whether the block kernels here serve ``x`` with ``block``: a power of two in [16, 1024], not fp64."""
    return x.dtype != torch.float64 and not block & (block - 1) and 16 <= block <= 1024


def launch_grid(rows: int, blocks: int, block: int) -> tuple[tuple[int, int], int]:
    """(grid, GROUPS) for ``rows`` rows of ``blocks`` blocks: about 2048 values a program."""
    groups = max(1, min(triton.next_power_of_2(blocks), 2048 // block))
    return (rows, triton.cdiv(blocks, groups)), groups


@triton.jit
def _act_quant_fp8_kernel(
    x_ptr, q_ptr, s_ptr, K, G,
    BLOCK: tl.constexpr, GROUPS: tl.constexpr, E8M0: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """E8M0: the scales as UE8M0 bytes e + 127 (``s_ptr`` a uint8 view), else fp32 2^e."""
    pdl_prologue(PDL)
    row, g, k, ok, x, amax = _row_blocks(x_ptr, K, G, BLOCK, GROUPS)
    e = _pow2_exponent(amax, 1e-4, 1.0 / 448.0)  # the DeepSeek kernels' fp32 multiply by 1/448
    y = x * _exp2_int(-e)[:, None]  # exact: same value as x / 2^e
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(q_ptr + row * K + k, _round_e4m3(y).to(tl.float8e4nv), mask=ok)
    if E8M0:
        tl.store(s_ptr + row * G + g, (e + 127).to(tl.uint8), mask=g < G)
    else:
        tl.store(s_ptr + row * G + g, _exp2_int(e), mask=g < G)


def act_quant_fp8_triton(
    x: torch.Tensor, block: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant_fp8`` for power-of-two ``block`` in [16, 1024]; other blocks go to the reference."""
    if not tiled_block(x, block):
        return act_quant_fp8_ref(x, block, scale_dtype)
    k = x.shape[-1]
    g = -(-k // block)
    x2 = x.reshape(-1, k).contiguous()
    rows = x2.shape[0]
    e8m0 = scale_dtype != torch.float32
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, g, dtype=torch.uint8 if e8m0 else torch.float32, device=x.device)
    if rows and k:
        grid, groups = launch_grid(rows, g, block)
        _act_quant_fp8_kernel[grid](
            x2, q, s, k, g, BLOCK=block, GROUPS=groups, E8M0=e8m0, num_warps=4, **pdl_options(x2.device)
        )
    s = s.view(torch.float8_e8m0fnu) if e8m0 else s
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], g)


register_backend(
    "act_quant_fp8",
    "triton",
    act_quant_fp8_triton,
    devices=("cuda",),
    priority=20,
    available=sm90_or_newer,
    batch_invariant=True,  # rows are independent and there is no reduction across rows
)

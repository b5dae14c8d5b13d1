"""Triton backends of the activation fake quantisers ``fake_quant_fp8_ue8m0`` and ``fake_quant_e2m1``.

V4.1 quantise-dequantises its window KV (FP8, UE8M0 scale per 32), its compressed KV (E2M1, E4M3 scale per 16)
and its index keys and indexer queries (E2M1, UE8M0 scale per 32) in every layer; the references spell each call
as two to three dozen small kernels (amax, scale bits, rounding, select), most of a V4.1 decode step's launches.
Here one program quantises GROUPS blocks of one row in one launch.

Bit-exact with the references: the UE8M0 exponent is read from the fp32 bits of max(amax, floor) * fp32(1/max)
(``formats.pow2_scale_exponent``), x / 2^e is the exact product x * 2^-e, the E4M3 scale amax / 6 is an IEEE
division rounded to nearest-even E4M3 in fp32 bits (``_round_e4m3``), and E2M1 rounds to nearest-even by
comparing against the grid's midpoints, keeping the sign of zero. Rows are independent: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.ops._pdl import pdl_prologue
from deepinfer_kernels.ops._triton_launch import pdl_options, require_same_device, triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import (
    E2M1_E4M3_AMAX_FLOOR,
    E2M1_UE8M0_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    fake_quant_e2m1_ref,
    fake_quant_fp8_ue8m0_ref,
)
from .triton import _exp2_int, _pow2_exponent, _round_e4m3, _row_blocks, launch_grid, tiled_block


@triton.jit
def _round_e2m1(v):
    """fp32 v rounded to nearest-even on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6, with v's sign
    (a negative value that rounds to zero gives -0.0)."""
    m = tl.abs(v)
    r = tl.where(m > 0.25, 0.5, 0.0)
    r = tl.where(m >= 0.75, 1.0, r)  # ties at .75, 1.75 and 3.5 go up (to the even code), the others down
    r = tl.where(m > 1.25, 1.5, r)
    r = tl.where(m >= 1.75, 2.0, r)
    r = tl.where(m > 2.5, 3.0, r)
    r = tl.where(m >= 3.5, 4.0, r)
    r = tl.where(m > 5.0, 6.0, r)
    sign = v.to(tl.int32, bitcast=True) & -0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fake_quant_kernel(
    x_ptr, out_ptr, D, G, floor,
    FP4: tl.constexpr, E4M3_SCALE: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_prologue(PDL)
    row, _, k, ok, x, amax = _row_blocks(x_ptr, D, G, BLOCK, GROUPS)
    if not FP4:  # FP8 e4m3 values, UE8M0 scale
        e = _pow2_exponent(amax, floor, 1.0 / 448.0)
        y = tl.minimum(tl.maximum(x * _exp2_int(-e)[:, None], -448.0), 448.0)
        out = _round_e4m3(y) * _exp2_int(e)[:, None]
    elif E4M3_SCALE:  # E2M1 values, E4M3 scale
        # IEEE divisions (div_rn): Triton's fp32 ``/`` is the approximate div.full on the GPU
        s = _round_e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, floor), 6.0), 448.0))
        out = _round_e2m1(tl.math.div_rn(x, s[:, None])) * s[:, None]
    else:  # E2M1 values, UE8M0 scale
        e = _pow2_exponent(amax, floor, 1.0 / 6.0)
        out = _round_e2m1(x * _exp2_int(-e)[:, None]) * _exp2_int(e)[:, None]
    tl.store(out_ptr + row * D + k, out.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, block: int, floor: float, fp4: bool, e4m3_scale: bool) -> torch.Tensor:
    require_same_device(x)
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    out = torch.empty_like(x2)
    if x2.numel():
        grid, groups = launch_grid(x2.shape[0], d // block, block)
        _fake_quant_kernel[grid](
            x2, out, d, d // block, floor, FP4=fp4, E4M3_SCALE=e4m3_scale, BLOCK=block, GROUPS=groups, num_warps=4,
            **pdl_options(x2.device),
        )  # fmt: skip
    return out.view(x.shape)


def fake_quant_fp8_ue8m0_triton(x: torch.Tensor, block: int) -> torch.Tensor:
    if not tiled_block(x, block):  # fp64 and other block sizes: the reference
        return fake_quant_fp8_ue8m0_ref(x, block)
    return _launch(x, block, FP8_AMAX_FLOOR, fp4=False, e4m3_scale=False)


def fake_quant_e2m1_triton(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    if not tiled_block(x, block):
        return fake_quant_e2m1_ref(x, block, scale_fmt)
    e4m3 = scale_fmt == "e4m3"
    return _launch(x, block, E2M1_E4M3_AMAX_FLOOR if e4m3 else E2M1_UE8M0_AMAX_FLOOR, fp4=True, e4m3_scale=e4m3)


for _op, _fn in (("fake_quant_fp8_ue8m0", fake_quant_fp8_ue8m0_triton), ("fake_quant_e2m1", fake_quant_e2m1_triton)):
    register_backend(
        _op, "triton", _fn, devices=("cuda",), priority=20, available=triton_cuda_available, batch_invariant=True
    )

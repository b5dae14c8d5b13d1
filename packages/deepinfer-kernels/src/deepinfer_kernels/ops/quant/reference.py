"""Plain-PyTorch quantisation formats (the definition of correct). Inputs are validated in __init__.py."""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import register_reference

from .formats import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    exp2_int,
    exponent_to_ue8m0,
    is_ue8m0,
    pack_e2m1,
    pow2_scale_exponent,
    ue8m0_bytes_to_float,
    unpack_e2m1,
)

FP8_AMAX_FLOOR = 1e-4  # DeepSeek act_quant / window-KV floor
E2M1_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # V4.1 index keys / indexer queries: scale >= 2^-126
E2M1_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # V4.1 compressed KV: scale >= 2^-9, the smallest e4m3 subnormal


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 view of a float8_e8m0fnu / uint8 (E8M0 bytes) / float32 scale tensor."""
    if is_ue8m0(scale):
        return ue8m0_bytes_to_float(scale)
    return scale.float()


def _block_amax_2d(w: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """fp32 max |w| per (b0 x b1) tile of [N, K]; edge tiles cover only the rows/columns that exist."""
    n, k = w.shape
    gn, gk = _cdiv(n, b0), _cdiv(k, b1)
    a = w.float().abs()
    # zero padding cannot change a max of absolute values
    a = torch.nn.functional.pad(a, (0, gk * b1 - k, 0, gn * b0 - n))
    return a.reshape(gn, b0, gk, b1).amax(dim=(1, 3))


def _expand_2d(s: torch.Tensor, b0: int, b1: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]


def _expand_last(s: torch.Tensor, block: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(block, dim=-1)[..., :k]


def _row_block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 max |x| per block of ``block`` along the last dim (the last block may be partial)."""
    k = x.shape[-1]
    g = _cdiv(k, block)
    a = torch.nn.functional.pad(x.float().abs(), (0, g * block - k))
    return a.reshape(*x.shape[:-1], g, block).amax(-1)


# ---------------------------------------------------------------- FP8 weights


@register_reference("fp8_block_quantize")
def fp8_block_quantize_ref(
    w: torch.Tensor, block: tuple[int, int], scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    b0, b1 = block
    n, k = w.shape
    amax = _block_amax_2d(w, b0, b1)
    if scale_fmt == "ue8m0":
        e = pow2_scale_exponent(amax, FP8_AMAX_FLOOR, FP8_E4M3_MAX)
        s = exp2_int(e)
        scale = exponent_to_ue8m0(e)
    else:  # "float": V3 / V4-Flash-Base style, s = amax / 448 with a true fp32 division
        s = amax.clamp_min(FP8_AMAX_FLOOR) / FP8_E4M3_MAX
        scale = s
    y = w.float() / _expand_2d(s, b0, b1, n, k)
    q = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


@register_reference("fp8_block_dequantize")
def fp8_block_dequantize_ref(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    b0, b1 = block
    n, k = q.shape
    s = _expand_2d(_scale_to_float(scale), b0, b1, n, k)
    return (q.float() * s).to(out_dtype)


# ---------------------------------------------------------------- MXFP4


@register_reference("mxfp4_quantize")
def mxfp4_quantize_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    e = pow2_scale_exponent(blocks.abs().amax(-1), E2M1_UE8M0_AMAX_FLOOR, E2M1_MAX)
    codes = e2m1_encode(blocks / exp2_int(e).unsqueeze(-1))
    return pack_e2m1(codes.view(n, k)), exponent_to_ue8m0(e)


@register_reference("mxfp4_dequantize")
def mxfp4_dequantize_ref(
    packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    n, half = packed.shape
    values = e2m1_decode(unpack_e2m1(packed)).view(n, half // 16, 32)
    return (values * ue8m0_bytes_to_float(scale).unsqueeze(-1)).view(n, 2 * half).to(out_dtype)


# ---------------------------------------------------------------- FP8 activations


@register_reference("act_quant_fp8")
def act_quant_fp8_ref(
    x: torch.Tensor, block: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    e = pow2_scale_exponent(_row_block_amax(x, block), FP8_AMAX_FLOOR, FP8_E4M3_MAX)
    s = exp2_int(e)
    y = x.float() / _expand_last(s, block, k)
    q = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (s if scale_dtype == torch.float32 else exponent_to_ue8m0(e))


@register_reference("act_dequant_fp8")
def act_dequant_fp8_ref(
    q: torch.Tensor, scale: torch.Tensor, block: int, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    s = _expand_last(_scale_to_float(scale), block, q.shape[-1])
    return (q.float() * s).to(out_dtype)


# ---------------------------------------------------------------- fake quantizers


@register_reference("e2m1_round")
def e2m1_round_ref(x: torch.Tensor) -> torch.Tensor:
    y = e2m1_decode(e2m1_encode(x))
    y = torch.where(torch.isnan(x), x.float(), y)
    return y.to(x.dtype)


@register_reference("fake_quant_fp8_ue8m0")
def fake_quant_fp8_ue8m0_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // block, block)
    s = exp2_int(pow2_scale_exponent(blocks.abs().amax(-1), FP8_AMAX_FLOOR, FP8_E4M3_MAX)).unsqueeze(-1)
    return (e4m3_round(blocks / s) * s).view(x.shape).to(x.dtype)


@register_reference("fake_quant_e2m1")
def fake_quant_e2m1_ref(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    d = x.shape[-1]
    blocks = x.float().reshape(*x.shape[:-1], d // block, block)
    amax = blocks.abs().amax(-1)
    if scale_fmt == "e4m3":
        s = e4m3_round(amax.clamp_min(E2M1_E4M3_AMAX_FLOOR) / E2M1_MAX)
    else:  # "ue8m0"
        s = exp2_int(pow2_scale_exponent(amax, E2M1_UE8M0_AMAX_FLOOR, E2M1_MAX))
    s = s.unsqueeze(-1)
    return (e2m1_decode(e2m1_encode(blocks / s)) * s).view(x.shape).to(x.dtype)

"""Bit-level helpers for the formats DeepSeek V4 / V4.1 store: FP8 e4m3fn, UE8M0 scales, E2M1 (FP4).

Everything here is exact: scales are built from exponent bits, never from ``log2``/``exp2`` in floating
point, so results do not depend on a libm.

* **E4M3** (OCP ``float8_e4m3fn``): finite max 448, no infinities; torch's cast rounds to nearest even.
* **UE8M0** (``float8_e8m0fnu``): one unsigned exponent byte ``e``, value ``2^(e-127)``; byte 0 is 2^-127
  (an fp32 subnormal), byte 255 is NaN. Power-of-two scales are stored as that byte; never convert E8M0
  bytes numerically.
* **E2M1** (FP4): a 4-bit code ``s e1 e0 m``. Codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; codes 8..15
  are the same magnitudes negated (code 8 is -0). Two codes per byte, the even element in the low nibble.
"""

from __future__ import annotations

import functools

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0

# code -> value; index = 4-bit code (sign in bit 3)
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip

# Midpoints between consecutive E2M1 magnitudes. A magnitude exactly on midpoint i sits between codes i
# and i + 1; round-to-nearest-even picks the even code, so ties go up only where i + 1 is even (i odd).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)

# UE8M0 scale tensors come as float8_e8m0fnu or as their raw bytes (uint8): powers of two by their format.
UE8M0_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e8m0fnu, torch.uint8)


def is_ue8m0(t: torch.Tensor) -> bool:
    """``t`` holds UE8M0 scales (float8_e8m0fnu or uint8 bytes), not float scales."""
    return t.dtype in UE8M0_DTYPES


_E8M0_MIN_EXP = -127  # byte 0
_E8M0_MAX_EXP = 127  # byte 254 (255 is NaN)


@functools.cache
def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """fp32 ``values`` on ``device``, made once: a fresh ``torch.tensor`` per call is a blocking host-to-device
    copy, which stalls the host behind the GPU queue (a sync per call in a decode step)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, sign in bit 3) of ``y`` rounded to nearest-even onto the E2M1 grid, saturating at 6.

    ``y`` is already divided by its scale. Negative values that round to zero keep the sign (code 8).
    NaN gives an unspecified code.
    """
    y = y.float()
    mag = y.abs().contiguous()
    mids = _constant(_E2M1_MIDPOINTS, y.device)
    # number of midpoints strictly below |y| = code of the lower neighbour when on a midpoint
    code = torch.bucketize(mag, mids, right=False)
    ties_up = torch.zeros_like(mag, dtype=torch.bool)
    for m in _E2M1_TIES_UP:
        ties_up |= mag == m
    code = code + ties_up.to(code.dtype)
    return (code | (torch.signbit(y).to(code.dtype) << 3)).to(torch.uint8)


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-entry code -> value table as fp32 on ``device``."""
    return _constant(tuple(E2M1_VALUES), torch.device(device))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes (any integer dtype holding 0..15)."""
    return e2m1_lut(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes (K even) -> [..., K/2] int8; element 2k in the low nibble, 2k+1 in the high one."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes (int8 / uint8 / float4_e2m1fn_x2) -> [..., K] uint8 codes."""
    u = packed.view(torch.uint8)
    return torch.stack((u & 0xF, u >> 4), dim=-1).flatten(-2)


def ceil_log2_exact(t: torch.Tensor) -> torch.Tensor:
    """int32 ``ceil(log2(t))`` for positive *normal* fp32 ``t``, read from the IEEE bits.

    t = 1.f * 2^(E-127): the answer is E-127 when the fraction f is zero (t a power of two), else E-126.
    Callers floor ``t`` so it is never zero or subnormal.
    """
    bits = t.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    frac_nonzero = (bits & 0x7FFFFF) != 0
    return biased - 127 + frac_nonzero.to(torch.int32)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^k`` for integer ``k`` in [-127, 127] (2^-127 is the fp32 subnormal 0x00400000)."""
    k = k.to(torch.int32)
    bits = torch.where(k > -127, (k + 127) << 23, torch.full_like(k, 0x00400000))
    return bits.view(torch.float32)


def ue8m0_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2^(b-127)`` of E8M0 bytes (uint8, or float8_e8m0fnu reinterpreted); 255 -> NaN."""
    u = b.view(torch.uint8) if b.dtype == torch.float8_e8m0fnu else b
    k = u.to(torch.int32) - 127
    out = exp2_int(k.clamp(max=_E8M0_MAX_EXP))
    return torch.where(u == 255, torch.full_like(out, float("nan")), out)


def pow2_scale_exponent(amax: torch.Tensor, floor: float, max_code: float) -> torch.Tensor:
    """int32 k with 2^k = 2^ceil(log2(max(amax, floor) * fp32(1/max_code))), clamped to E8M0's range.

    This is the UE8M0 scale of the DeepSeek reference kernels (``amax * (1/max)`` in fp32, then the
    exponent bits). For max_code 448 and 6, fp32(1/max_code) is slightly above 1/max_code and the product
    equals the exact ``ceil(log2(amax/max_code))`` for every normal fp32 amax (the tests check every
    value within 2^18 ulps of the binade edges, the only place a rounding error could matter), i.e. 2^k
    is the smallest power of two with amax / 2^k <= max_code.
    """
    inv = _constant((1.0 / max_code,), amax.device)[0]
    t = amax.float().clamp_min(floor) * inv
    return ceil_log2_exact(t).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)


def exponent_to_ue8m0(k: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu tensor holding 2^k (k int in [-127, 127]), built from the byte k + 127."""
    return (k.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to the nearest-even float8_e4m3fn value, saturating at +-448."""
    return x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()

"""Quantisation formats of DeepSeek V4 / V4.1: FP8 block weights, MXFP4 experts, FP8 activations, and the
V4.1 fake quantizers (quantise-then-dequantise) that are part of the trained function.

Formats (see formats.py for the bit layouts):

* FP8 = OCP ``float8_e4m3fn`` (max 448, never FNUZ); torch's cast rounds to nearest even.
* UE8M0 = ``float8_e8m0fnu``: one exponent byte ``e`` per block, scale ``2^(e-127)``. A raw-byte (uint8)
  view is accepted wherever a UE8M0 scale is read.
* E2M1 = FP4 codes ``s e1 e0 m``: 0..7 -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8..15 the negatives (8 = -0).
  Rounding is to nearest with ties to the even code (the value whose mantissa bit is 0: a tie at 0.25
  goes to 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); magnitudes above 6 saturate.

Power-of-two (UE8M0) scales everywhere are ``2^ceil(log2(max(amax, floor) * fp32(1/max_code)))`` computed
from fp32 exponent bits, as the DeepSeek reference kernels do; for max_code 448 and 6 this equals the
exact ``ceil(log2(max(amax, floor) / max_code))``: the smallest power of two with amax / scale <= max_code.
All arithmetic is fp32. Inputs are expected finite; NaN/inf behaviour is unspecified except where stated.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)
from .formats import UE8M0_DTYPES

try:  # the Triton backends (act_quant_fp8, the fake quantisers, the dequantisers) register themselves
    from . import dequant_triton as _dequant_triton  # noqa: F401
    from . import fake_quant_triton as _fake_quant_triton  # noqa: F401
except ImportError:
    pass

_HIGH_PRECISION = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UE8M0_OR_F32 = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _HIGH_PRECISION:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be a float16/bfloat16/float32/float64 tensor, got {got}")


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in allowed:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must have dtype in {[str(d) for d in allowed]}, got {got}")


def _check_dim(op: str, name: str, t: torch.Tensor, dims: int | None) -> None:
    if dims is None:
        if t.dim() < 1:
            raise ValueError(f"{op}: {name} must have at least one dimension, got a scalar")
    elif t.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(t.shape)}")


def _check_block_2d(op: str, block) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    ok = ok and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    if not ok:
        raise ValueError(f"{op}: block must be a pair of positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _check_block(op: str, block) -> int:
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"{op}: block must be a positive int, got {block!r}")
    return block


def _check_out_dtype(op: str, out_dtype) -> None:
    if out_dtype not in _HIGH_PRECISION:
        raise ValueError(f"{op}: out_dtype must be one of float16/bfloat16/float32/float64, got {out_dtype}")


def _check_scale_shape(op: str, scale: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(f"{op}: scale shape {tuple(scale.shape)} != expected {tuple(expected)}")


def _check_same_device(op: str, a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{op}: {names} are on different devices ({a.device}, {b.device})")


# ---------------------------------------------------------------- FP8 weights


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int], scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix to FP8 e4m3fn with one scale per (b0 x b1) tile.

    For tile (i, j) covering rows [i*b0, (i+1)*b0) and columns [j*b1, (j+1)*b1) (clipped to the matrix:
    edge tiles may be partial and use only the elements that exist), amax = max |w| over the tile, floored
    at 1e-4 (so all-zero tiles get a finite scale and zero codes), and

    * ``scale_fmt="ue8m0"`` (V4 128x128, V4.1 32x32 checkpoints): s = 2^ceil(log2(amax/448)), returned as
      ``float8_e8m0fnu``;
    * ``scale_fmt="float"`` (V3 / V4-Flash-Base style): s = amax/448 (fp32 division), returned as float32.

    q = e4m3(clamp(w / s, -448, 448)) with round-to-nearest-even; w ~= q * s (``fp8_block_dequantize``).

    Args:
        w: [N, K] float16/bfloat16/float32/float64 (read in fp32).
        block: (b0, b1) positive tile size along (N, K).
        scale_fmt: "ue8m0" or "float".

    Returns:
        q: [N, K] float8_e4m3fn.
        scale: [ceil(N/b0), ceil(K/b1)] float8_e8m0fnu ("ue8m0") or float32 ("float").
    """
    op = "fp8_block_quantize"
    _check_float(op, "w", w)
    _check_dim(op, "w", w, 2)
    block = _check_block_2d(op, block)
    if scale_fmt not in ("ue8m0", "float"):
        raise ValueError(f"{op}: scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
    return dispatch(op, w.device, w, block, scale_fmt)


def fp8_block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """out[n, k] = q[n, k] * scale[n // b0, k // b1], computed in fp32 then cast to ``out_dtype``.

    Args:
        q: [N, K] float8_e4m3fn.
        scale: [ceil(N/b0), ceil(K/b1)]: float8_e8m0fnu, uint8 (raw E8M0 bytes, value 2^(byte-127); 255 is
            NaN) or float32.
        block: (b0, b1) tile size the scales were made with.
        out_dtype: float16/bfloat16/float32/float64.

    Returns:
        [N, K] in ``out_dtype``. With a power-of-two scale the fp32 product is exact (barring fp32
        overflow/underflow).
    """
    op = "fp8_block_dequantize"
    _check_dtype(op, "q", q, (torch.float8_e4m3fn,))
    _check_dim(op, "q", q, 2)
    _check_dtype(op, "scale", scale, _UE8M0_OR_F32)
    b0, b1 = _check_block_2d(op, block)
    _check_scale_shape(op, scale, (_cdiv(q.shape[0], b0), _cdiv(q.shape[1], b1)))
    _check_out_dtype(op, out_dtype)
    _check_same_device(op, q, scale, "q and scale")
    return dispatch(op, q.device, q, scale, (b0, b1), out_dtype)


# ---------------------------------------------------------------- MXFP4


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight matrix to MXFP4: E2M1 codes with one UE8M0 scale per 32 consecutive elements of K.

    For group g of row n (elements [32g, 32g+32)): amax = max |w| floored at 6*2^-126 (so an all-zero
    group gets scale 2^-126 and zero codes), s = 2^ceil(log2(amax/6)) -- the smallest power of two with
    amax/s <= 6 --, and code = E2M1 round-to-nearest-even of w/s (saturating at +-6; negative values that
    round to zero get code 8, i.e. -0). Equals ``fake_quant_e2m1(w, 32, "ue8m0")`` after dequantisation.

    Byte layout (the V4 / V4.1 routed-expert checkpoint layout; view as float4_e2m1fn_x2 if wanted):
    packed[n, k] holds element 2k in its LOW nibble and element 2k+1 in its HIGH nibble.

    Args:
        w: [N, K] float16/bfloat16/float32/float64; K must be a multiple of 32.

    Returns:
        packed: [N, K/2] int8.
        scale: [N, K/32] float8_e8m0fnu.
    """
    op = "mxfp4_quantize"
    _check_float(op, "w", w)
    _check_dim(op, "w", w, 2)
    if w.shape[1] % 32:
        raise ValueError(f"{op}: K = w.shape[1] = {w.shape[1]} must be a multiple of 32 (the MXFP4 group)")
    return dispatch(op, w.device, w)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out[n, k] = E2M1(code of element k) * 2^(e[n, k // 32] - 127), computed in fp32.

    Args:
        packed: [N, K/2] int8, uint8 or float4_e2m1fn_x2; element 2k in the low nibble, 2k+1 in the high.
            K/2 must be a multiple of 16.
        scale: [N, K/32] float8_e8m0fnu or uint8 (raw E8M0 bytes; byte 255 gives NaN).
        out_dtype: float16/bfloat16/float32/float64.

    Returns:
        [N, K] in ``out_dtype`` (exact in fp32: grid values times powers of two).
    """
    op = "mxfp4_dequantize"
    allowed = (torch.int8, torch.uint8)
    if hasattr(torch, "float4_e2m1fn_x2"):
        allowed = allowed + (torch.float4_e2m1fn_x2,)
    _check_dtype(op, "packed", packed, allowed)
    _check_dim(op, "packed", packed, 2)
    if packed.shape[1] % 16:
        raise ValueError(
            f"{op}: packed.shape[1] = {packed.shape[1]} must be a multiple of 16 (K = 2 * packed.shape[1] "
            "must be a multiple of 32)"
        )
    _check_dtype(op, "scale", scale, UE8M0_DTYPES)
    _check_scale_shape(op, scale, (packed.shape[0], packed.shape[1] // 16))
    _check_out_dtype(op, out_dtype)
    _check_same_device(op, packed, scale, "packed and scale")
    return dispatch(op, packed.device, packed, scale, out_dtype)


# ---------------------------------------------------------------- FP8 activations


def act_quant_fp8(
    x: torch.Tensor, block: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(1 x block) FP8 quantisation of activations with power-of-two scales (V4: 128, V4.1: 32).

    For each block of ``block`` consecutive elements along the last dim (the last block may be partial):
    s = 2^ceil(log2(max(amax, 1e-4)/448)), q = e4m3(clamp(x / s, -448, 448)), round-to-nearest-even.

    Args:
        x: [..., K] float16/bfloat16/float32/float64.
        block: positive int.
        scale_dtype: float32 (default) or float8_e8m0fnu: the same powers of two as UE8M0 bytes (a quarter of
            the bytes, and a dtype that says "power of two": ``fp8_gemm_nt``'s bf16 routes take only such scales).

    Returns:
        q: [..., K] float8_e4m3fn.
        scale: [..., ceil(K/block)] ``scale_dtype``, every entry a power of two.
    """
    op = "act_quant_fp8"
    _check_float(op, "x", x)
    _check_dim(op, "x", x, None)
    block = _check_block(op, block)
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"{op}: scale_dtype must be torch.float32 or torch.float8_e8m0fnu, got {scale_dtype}")
    return dispatch(op, x.device, x, block, scale_dtype)


def act_dequant_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: int, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """out[..., k] = q[..., k] * scale[..., k // block] in fp32, cast to ``out_dtype``.

    Args:
        q: [..., K] float8_e4m3fn.
        scale: [..., ceil(K/block)] float32, float8_e8m0fnu or uint8 (raw E8M0 bytes).
        block: positive int.
        out_dtype: float16/bfloat16/float32/float64.
    """
    op = "act_dequant_fp8"
    _check_dtype(op, "q", q, (torch.float8_e4m3fn,))
    _check_dim(op, "q", q, None)
    _check_dtype(op, "scale", scale, _UE8M0_OR_F32)
    block = _check_block(op, block)
    _check_scale_shape(op, scale, (*q.shape[:-1], _cdiv(q.shape[-1], block)))
    _check_out_dtype(op, out_dtype)
    _check_same_device(op, q, scale, "q and scale")
    return dispatch(op, q.device, q, scale, block, out_dtype)


# ---------------------------------------------------------------- fake quantizers


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round values (already divided by their scale) to the signed E2M1 grid, nearest with ties to even.

    {0, 0.5, 1, 1.5, 2, 3, 4, 6} and negatives; |x| > 6 (inf included) saturates to +-6, the sign of zero
    results follows x, NaN stays NaN. Computed in fp32; returns x.dtype and x.shape.
    """
    op = "e2m1_round"
    _check_float(op, "x", x)
    return dispatch(op, x.device, x)


def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 e4m3 quantise-dequantise with a UE8M0 scale per block of ``block`` along the last dim.

    Per block: s = 2^ceil(log2(max(amax, 1e-4)/448)), out = e4m3(clamp(x / s, -448, 448)) * s (x / s is
    exact: s is a power of two). V4.1 applies it to the whole 512-dim post-RoPE window KV with block 32
    (RoPE channels included); V4 to the 448 NoPE dims with block 64. Formula as in oracle_notes.md and the
    HF transformers-main ``deepseek_v41`` port. Idempotent. Computed in fp32.

    Args:
        x: [..., D] float16/bfloat16/float32/float64; D must be a multiple of ``block`` (the HF oracle
            silently skips quantisation for such shapes; a caller that wants that must skip the call).
        block: positive int.

    Returns:
        [..., D] in x.dtype.
    """
    op = "fake_quant_fp8_ue8m0"
    _check_float(op, "x", x)
    _check_dim(op, "x", x, None)
    block = _check_block(op, block)
    if x.shape[-1] % block:
        raise ValueError(f"{op}: last dim of x ({x.shape[-1]}) must be a multiple of block ({block})")
    return dispatch(op, x.device, x, block)


def fake_quant_e2m1(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    """E2M1 (FP4) quantise-dequantise with one scale per block of ``block`` along the last dim.

    Per block, amax = max |x| and

    * ``scale_fmt="e4m3"`` (V4.1 compressed KV, block 16): s = e4m3(min(max(amax, 6*2^-9) / 6, 448)),
      i.e. amax/6 (fp32 division) rounded to nearest-even e4m3, never below 2^-9 (the smallest e4m3
      subnormal) -- so an all-zero block gets s = 2^-9;
    * ``scale_fmt="ue8m0"`` (V4.1 index keys and indexer queries, block 32; also MXFP4):
      s = 2^ceil(log2(max(amax, 6*2^-126) / 6)), the smallest power of two >= 2^-126 with amax/s <= 6;

    then out = e2m1_round(clamp(x / s, -6, 6)) * s, x / s an fp32 division.

    The floors (6*2^-9 for e4m3, 6*2^-126 for ue8m0) are those of oracle_notes.md, model_v41_flash.md 3.3
    and model_v4_and_v41_from_reference_code.md Part E item 9; they agree with the HF transformers-main
    ``deepseek_v41`` port. The upper clamp of the e4m3 scale at 448 (amax > 2688) follows vLLM's
    ``clamp(amax/6, 2^-9, 448)``; the HF port casts without clamping (NaN or saturation depending on the
    torch version).

    Idempotent for ``"ue8m0"``. For ``"e4m3"`` idempotent except for blocks with 9*2^-9 <= amax <= 10*2^-9
    (about 0.0176..0.0195): there amax/6 rounds up to the subnormal scale 2^-8, the largest element
    becomes 4*s, and a second pass picks s = 2^-9 and moves it again (to 6*2^-9).

    Args:
        x: [..., D] float16/bfloat16/float32/float64; D must be a multiple of ``block``.
        block: positive int.
        scale_fmt: "e4m3" or "ue8m0".

    Returns:
        [..., D] in x.dtype.
    """
    op = "fake_quant_e2m1"
    _check_float(op, "x", x)
    _check_dim(op, "x", x, None)
    block = _check_block(op, block)
    if scale_fmt not in ("e4m3", "ue8m0"):
        raise ValueError(f"{op}: scale_fmt must be 'e4m3' or 'ue8m0', got {scale_fmt!r}")
    if x.shape[-1] % block:
        raise ValueError(f"{op}: last dim of x ({x.shape[-1]}) must be a multiple of block ({block})")
    return dispatch(op, x.device, x, block, scale_fmt)


__all__ = [
    "fp8_block_quantize",
    "fp8_block_dequantize",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "act_quant_fp8",
    "act_dequant_fp8",
    "e2m1_round",
    "fake_quant_fp8_ue8m0",
    "fake_quant_e2m1",
]

"""FP8 x FP8 GEMM with block scales (DeepGEMM's ``fp8_gemm_nt``): C = A . B^T, A activations, B weights.

Two scale layouts, selected by ``block``:

* ``block=128`` (V3 / V4): A has one scale per 1 x 128 group along K (``act_quant_fp8(x, 128)``), B one per
  128 x 128 tile (``fp8_block_quantize(w, (128, 128))``);
* ``block=32`` (V4.1 MXFP8 dense weights): A one scale per 1 x 32 group (``act_quant_fp8(x, 32)``), B one
  UE8M0 scale per 32 x 32 tile (the checkpoint's ``X.scale``).

A linear layer of high-precision x: ``quantize_fp8_activations`` then ``fp8_gemm_activations`` (``activations.py``;
one quantisation may serve several weights), which hands prefill-size calls their activations already in bf16.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.quant.formats import UE8M0_DTYPES
from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)

_SCALE_DTYPES = (torch.float32, *UE8M0_DTYPES)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_gemm_nt(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """c[..., n] = sum_k (a[..., k] * a_scale[..., k // block]) * (b[n, k] * b_scale[n // block, k // block]).

    Mathematically the fp32 product of the two dequantised operands, cast once to ``out_dtype``. Backends
    accumulate in fp32, one K-block of ``block`` at a time (each block's partial product is scaled by
    a_scale * b_scale and added) or, for UE8M0 scales on both operands, as a bf16 GEMM of the exactly dequantised
    operands (e4m3 times a power of two fits bf16), so results agree with the reference to fp32 summation-order
    error.

    Args:
        a: [..., K] float8_e4m3fn activations (leading dims flattened to M rows), K a multiple of ``block``.
        a_scale: [..., K / block] float32 (as ``act_quant_fp8`` returns), float8_e8m0fnu or uint8 (UE8M0 bytes).
        b: [N, K] float8_e4m3fn weights, row-major (K contiguous: the "NT" layout).
        b_scale: [ceil(N / block), K / block] float32, float8_e8m0fnu or uint8.
        block: 128 (1x128 / 128x128 scales) or 32 (MXFP8: 1x32 / 32x32).
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [..., N] in ``out_dtype``. Rows are independent of each other; the GPU backends registered as
        batch-invariant use a tiling that does not depend on M.
    """
    op = "fp8_gemm_nt"
    if block not in (32, 128):
        raise ValueError(f"{op}: block must be 32 or 128, got {block!r}")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{op}: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a.dim() < 1 or b.dim() != 2 or a.shape[-1] != b.shape[1]:
        raise ValueError(f"{op}: a {tuple(a.shape)} and b {tuple(b.shape)} do not fit ([..., K] x [N, K])")
    n, k = b.shape
    if k % block:
        raise ValueError(f"{op}: K = {k} must be a multiple of block = {block}")
    if a_scale.dtype not in _SCALE_DTYPES or b_scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{op}: scales must be float32, float8_e8m0fnu or uint8, got {a_scale.dtype}, {b_scale.dtype}")
    if tuple(a_scale.shape) != (*a.shape[:-1], k // block):
        raise ValueError(f"{op}: a_scale {tuple(a_scale.shape)} != {(*a.shape[:-1], k // block)}")
    if tuple(b_scale.shape) != (_cdiv(n, block), k // block):
        raise ValueError(f"{op}: b_scale {tuple(b_scale.shape)} != {(_cdiv(n, block), k // block)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if len({t.device for t in (a, a_scale, b, b_scale)}) != 1:
        raise ValueError(f"{op}: a, a_scale, b and b_scale must be on one device")
    return dispatch(op, a.device, a, a_scale, b, b_scale, block, out_dtype)


try:  # GPU backends register themselves when Triton imports (CPU-only installs have none)
    from ..quant import triton as _quant_triton  # noqa: F401  (act_quant_fp8's Triton backend)
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
try:  # the decode-size kernel in Gluon (Triton >= 3.4)
    from . import gluon as _gluon  # noqa: F401
except ImportError:
    pass

from .activations import Fp8Activations, fp8_gemm_activations, quantize_fp8_activations  # noqa: E402

__all__ = ["Fp8Activations", "fp8_gemm_activations", "fp8_gemm_nt", "quantize_fp8_activations"]

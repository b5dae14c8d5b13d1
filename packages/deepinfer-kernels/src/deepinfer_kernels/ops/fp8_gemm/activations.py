"""An FP8 linear's activations made once in the form its GEMM reads: ``quantize_fp8_activations`` then
``fp8_gemm_activations`` (one quantisation may serve several weights of the same input and block).

The computation is always ``fp8_gemm_nt(*act_quant_fp8(x, block, UE8M0 scales), w, w_scale, block)``. The form
differs at prefill sizes, where ``fp8_gemm_nt``'s Gluon backend multiplies bf16 operands (``dequant_mm.py``: an
e4m3 value times a power-of-two scale is exact in bf16): quantising x to e4m3 only for that backend to dequantise it
again costs an extra pass (read x, write e4m3 + scales, read them back, write bf16: 6 bytes an element in two
launches). There ``fake_quant_fp8_ue8m0`` makes the same bf16 numbers in one launch (read x, write bf16: 4 bytes),
bitwise ``act_dequant_fp8(*act_quant_fp8(x))``, and the GEMM is that route's own (``dequant_mm_bf16``): the output
has the bits of ``fp8_gemm_nt`` on the e4m3 operands. Anywhere else (decode sizes, 128-blocks, batch-invariant mode,
forced references, CPU) the e4m3 form and ``fp8_gemm_nt``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_kernels.ops.quant import act_quant_fp8, fake_quant_fp8_ue8m0
from deepinfer_kernels.ops.quant.formats import is_ue8m0
from deepinfer_kernels.registry import resolve

from . import fp8_gemm_nt
from .dequant_mm import dequant_mm_bf16

try:  # the Gluon backend, whose dequant route the bf16 form feeds (absent with older Triton or none)
    from . import gluon as _gluon
except ImportError:
    _gluon = None


@dataclass(frozen=True)
class Fp8Activations:
    """x [M, K] quantised per 1 x ``block`` with UE8M0 scales: e4m3 ``q`` [M, K] and ``scale`` [M, K / block]
    (float8_e8m0fnu), or ``values`` [M, K] bf16, the same numbers dequantised (for a GEMM on bf16 operands)."""

    block: int
    q: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    values: torch.Tensor | None = None


# Hand the bf16 route its activations in bf16 (one fake-quant launch instead of act_quant + act_dequant: the same
# bits, 4 bytes an element of x instead of 6). Off until its GPU test and a model A/B have run (written in session
# 39, which had no device).
BF16_FORM = False


def _bf16_route(x: torch.Tensor, block: int) -> bool:
    """Whether ``fp8_gemm_nt`` of x's rows runs on bf16 operands here: the Gluon backend is the one chosen for the
    device and sends such calls to ``dequant_mm`` (its DEQUANT_MM_FROM_M / DEQUANT_MM_BLOCKS, read at call time)."""
    if not BF16_FORM or _gluon is None or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    # the row count first: decode-size calls (every step's hot path) stop before the registry lookup
    return _gluon.dequant_mm_route(x.shape[0], block) and resolve("fp8_gemm_nt", x.device) is _gluon.fp8_gemm_nt_gluon


def quantize_fp8_activations(x: torch.Tensor, block: int) -> Fp8Activations:
    """x [M, K] (float, K a multiple of ``block``) -> its ``Fp8Activations`` for ``fp8_gemm_activations``."""
    if _bf16_route(x, block):
        return Fp8Activations(block, values=fake_quant_fp8_ue8m0(x, block))
    # UE8M0 scales: the same powers of two in a quarter of the bytes, and a dtype fp8_gemm_nt can trust to be powers
    # of two (its bf16 routes dequantise exactly only then)
    q, scale = act_quant_fp8(x, block, scale_dtype=torch.float8_e8m0fnu)
    return Fp8Activations(block, q=q, scale=scale)


def fp8_gemm_activations(
    act: Fp8Activations, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``fp8_gemm_nt`` of the quantised activations and weights b [N, K] (e4m3, NT layout) with b_scale [ceil(N /
    block), K / block]: [M, N] in ``out_dtype``."""
    if act.values is None:
        return fp8_gemm_nt(act.q, act.scale, b, b_scale, act.block, out_dtype)
    if not is_ue8m0(b_scale):  # float weight scales need the per-block rescale: back to e4m3 (the same numbers)
        q, scale = act_quant_fp8(act.values, act.block, scale_dtype=torch.float8_e8m0fnu)
        return fp8_gemm_nt(q, scale, b, b_scale, act.block, out_dtype)
    if act.values.shape[-1] != b.shape[1]:
        raise ValueError(
            f"fp8_gemm_activations: activations [M, {act.values.shape[-1]}] and b {tuple(b.shape)} do not fit"
        )
    return dequant_mm_bf16(act.values, b, b_scale, act.block, out_dtype)

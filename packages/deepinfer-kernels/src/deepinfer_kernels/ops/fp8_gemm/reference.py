"""Plain-PyTorch FP8 block-scaled GEMM (the definition of correct): dequantise both operands to fp32 with
the quant references, multiply with the row-invariant ``linear_ref`` in fp32, cast once."""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.linear.reference import linear_ref
from deepinfer_kernels.ops.quant.reference import act_dequant_fp8_ref, fp8_block_dequantize_ref
from deepinfer_kernels.registry import register_reference


@register_reference("fp8_gemm_nt")
def fp8_gemm_nt_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: int = 128,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    a32 = act_dequant_fp8_ref(a, a_scale, block, torch.float32)
    b32 = fp8_block_dequantize_ref(b, b_scale, (block, block), torch.float32)
    return linear_ref(a32, b32).to(out_dtype)

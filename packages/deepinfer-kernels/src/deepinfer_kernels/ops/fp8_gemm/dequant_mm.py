"""``fp8_gemm_nt`` at prefill sizes: both operands dequantised to bf16 (``act_dequant_fp8``, ``fp8_block_dequantize``:
one elementwise pass each), then one cuBLAS bf16 GEMM.

Why: at thousands of rows the GEMM is bound by the tensor cores, and the Triton kernel (``triton.py``) rescales its
fp32 accumulator every K block (each 32 or 128 of K: a multiply-add of the whole tile on the CUDA cores, on the
critical path of every FP8 wgmma). An e4m3 value times a power-of-two scale has 4 significant bits and fits bf16
exactly (above 2^-130: UE8M0 scale bytes >= 6, every checkpoint's), so the bf16 operands are the dequantised
values of the op's definition and their products are exact in cuBLAS's fp32 sums: results differ from the
reference only in the order of those sums. The weight pass costs 3 bytes a weight (read FP8, write bf16, which
the GEMM reads back), small beside the GEMM at these sizes. The values are exact only for power-of-two scales,
so the dispatch (``gluon.py``) sends only UE8M0 scales here.

Measured (device time, CUDA graphs, us Triton -> this) on an H100, session 33, at 1024 / 4096 rows: V4.1 wq_a
67 -> 41 / 225 -> 104, wq_b 321 -> 168 / 1279 -> 496, wkv 37 -> 26 / 110 -> 68, wo_b 272 -> 178 / 1100 -> 543,
shared w13 193 -> 99 / 586 -> 290, shared w2 79 -> 56 / 287 -> 153; hence DEQUANT_MM_FROM_M = 1024 (at 256 rows
it loses to the split Triton kernel on most shapes). 128-blocks rescale a quarter as often and Triton's kernel
reaches 500-730 TFLOP/s there: V4 wq_b 527 -> 437, wo_b 381 -> 445 at 4096 rows, hence DEQUANT_MM_BLOCKS = (32,).
(Session 32's H200 ``bench_fp8_gemm.py`` times at 1024 rows, where this lost, were host-bound: three launches
and two allocations against one kernel.)
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.quant import act_dequant_fp8, fp8_block_dequantize


def fp8_gemm_nt_dequant_mm(a, a_scale, b, b_scale, block=128, out_dtype=torch.bfloat16):
    """``fp8_gemm_nt`` as dequantise + ``torch.mm`` (see the module docstring); fp32 and fp16 outputs come from
    fp32 GEMM outputs (one rounding)."""
    k = a.shape[-1]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    x = act_dequant_fp8(a2, a_scale.reshape(a2.shape[0], -1), block, torch.bfloat16)
    y = dequant_mm_bf16(x, b, b_scale, block, out_dtype)
    return y.reshape(*lead, b.shape[0])


def dequant_mm_bf16(x, b, b_scale, block, out_dtype=torch.bfloat16):
    """The GEMM half of ``fp8_gemm_nt_dequant_mm``: x [M, K] bf16 (dequantised activations) times the dequantised
    weights b [N, K] (e4m3, ``b_scale`` UE8M0 per block x block), one cuBLAS GEMM: [M, N] in ``out_dtype``."""
    w = fp8_block_dequantize(b, b_scale, (block, block), torch.bfloat16)
    if out_dtype == torch.bfloat16:
        return torch.mm(x, w.t())
    return torch.mm(x, w.t(), out_dtype=torch.float32).to(out_dtype)

"""GPU backend of ``moe_experts`` for dense expert stacks (bf16 or fp32 w13 / w2): the grouped-GEMM ops, with
no host synchronisation and no copies of expert weights.

* few (token, slot) rows (decode; ``gather_layout``): ``grouped_gemm_gather`` for gate/up (each row reads
  x[token] in place, token = row // k, and its expert's weights) then for the down projection, in (token, slot)
  order, which the unpermute reads as it is (no index tensors: three launches fewer on a batch-1 step's chain);
* more rows (prefill, larger decode batches): ``moe_sort_rows_triton`` (the (token, slot) rows sorted by expert, on
  the device, with each sorted row's token and routing weight and each pair's sorted row; one launch up to 4096
  rows), one tile list for both GEMMs, ``grouped_gemm`` for gate/up reading each sorted row's token in place
  (``row_index``), and for down;

then ``moe_unpermute`` sums each token's k rows in slot order (fp32) and casts to x.dtype once. The gate/up
GEMM fuses the clamped SwiGLU and the routing weight (before the down projection, as the reference). With bf16
weights it writes the hidden state in bf16, which the down GEMM reads in one tensor-core pass, as transformers'
and vLLM's MoE layers do (DeepSeek's own kernels quantise it to FP8): an fp32 hidden state would cost three
bf16 passes of the down GEMM (its exact split), 1.7x the expert FLOPs of a prefill. fp32 weights or fp32
activations keep it fp32.

Against ``moe_experts_ref`` (fp32 hidden state) the result differs by that rounding (about 1e-3 relative) and
the order of fp32 sums: within each dot product, and a token adds its k expert outputs in slot order where the
reference adds them in ascending expert id.

Batch-invariant: a (token, slot) row gets the same bits in either layout and whatever the other rows are (see
``grouped_gemm.triton``), and the slot-order sum is the token's own, so the layout threshold (shapes only)
cannot change a token's result either; registered ``batch_invariant=True`` (the GPU tests check a token alone
against the same token among 8, 512 and 4096, bitwise).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops._triton_launch import triton_cuda_available
from deepinfer_kernels.registry import register_backend

from .reference import moe_experts_ref

# at most one (token, slot) row per GATHER_EXPERTS_PER_ROW experts takes the gathered layout: rows of one
# expert re-read its weights there, which the sorted layout avoids at the price of the sort and the tile list, so
# the crossing depends on how many rows share an expert. Uniform random routing (bench_grouped_gemm.py
# --threshold, V4-Flash, H200, session 8): gathered 0.504 / 0.938 / 1.288 ms against sorted 0.520 / 0.914 /
# 1.217 ms per layer at 8 / 16 / 21 tokens. The model slices route 48 rows of 8 tokens to 20-30 experts (skew a
# trained router and speculative verification show too); whole decode steps there (gpu_model_slice.py, session 10,
# pipelined ms, gathered vs sorted): V4 1.54 / 1.78 / 2.11 / 2.80 vs 1.61 / 1.87 / 2.16 / 2.66 and V4.1 3.11 /
# 3.76 / 4.86 / 6.46 vs 3.40 / 4.01 / 4.90 / 6.02 at batch 1 / 2 / 4 / 8. 10 gathers up to 4 tokens on V4
# (256 experts, top-6) and 6 on V4.1 (384): the skewed steps' crossing, at most ~3% behind on uniform routing.
GATHER_EXPERTS_PER_ROW = 10


def gather_layout(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """True when ``moe_experts_triton`` uses the gathered (decode) layout; from shapes only."""
    return num_tokens * top_k * GATHER_EXPERTS_PER_ROW <= num_experts


def moe_experts_triton(x, experts, weights, w13, w2, *, swiglu_limit):
    # imported here: grouped_gemm's reference imports this package (swiglu_clamp_ref). Both layouts call the Triton
    # functions themselves (this is their backend): they take what the op contracts do not (the gathered rows'
    # token = row // k, the sort's extra outputs, one tile list for both GEMMs).
    from deepinfer_kernels.ops.grouped_gemm.triton import (
        grouped_block_m,
        grouped_gemm_gather_triton,
        grouped_gemm_triton,
    )
    from deepinfer_kernels.ops.grouped_tiles import expert_tile_schedule
    from deepinfer_kernels.ops.moe_permute.triton import moe_sort_rows_triton, moe_unpermute_triton

    dense = (torch.bfloat16, torch.float32)
    if w13.dtype not in dense or w2.dtype not in dense or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return moe_experts_ref(x, experts, weights, w13, w2, swiglu_limit=swiglu_limit)
    t, k = experts.shape
    if t == 0 or k == 0:
        return x.new_zeros(x.shape)
    num_experts = w13.shape[0]
    flat_e = experts.reshape(-1)
    flat_w = weights.reshape(-1).float()
    f32 = torch.float32
    # the down GEMM's input (module docstring): bf16 for a 16-bit model with bf16 weights
    hidden = torch.bfloat16 if w2.dtype == torch.bfloat16 and x.dtype != f32 else f32
    if gather_layout(t, k, num_experts):  # pair p = t * k + i reads token t; the unpermute reads y in pair order
        h = grouped_gemm_gather_triton(
            x, w13, flat_e, rows_per_input=k, fuse_swiglu=True, swiglu_limit=swiglu_limit, row_scale=flat_w,
            out_dtype=hidden,
        )  # fmt: skip
        y = grouped_gemm_gather_triton(h, w2, flat_e, out_dtype=f32)
        return moe_unpermute_triton(y, None, t, None, out_dtype=x.dtype)
    # the sort also writes each sorted row's token and routing weight and each pair's sorted row (one launch for
    # what order // k, flat_w[order] and the unpermute's inverse took three), and both GEMMs share one tile list
    order, offsets, inverse, row_token, row_weight = moe_sort_rows_triton(experts, flat_w, num_experts)
    rows = order.shape[0]
    block_m = grouped_block_m(w13, rows)
    schedule = expert_tile_schedule(offsets, rows, block_m)
    h = grouped_gemm_triton(  # the sorted rows read the tokens in place (no sorted copy of x)
        x, w13, offsets, row_index=row_token, fuse_swiglu=True, swiglu_limit=swiglu_limit, row_scale=row_weight,
        out_dtype=hidden, schedule=schedule,
    )  # fmt: skip
    same = grouped_block_m(w2, rows) == block_m
    y = grouped_gemm_triton(h, w2, offsets, out_dtype=f32, schedule=schedule if same else None)
    return moe_unpermute_triton(y, order, t, None, out_dtype=x.dtype, inverse=inverse)


register_backend(
    "moe_experts", "triton", moe_experts_triton, devices=("cuda",), priority=20, available=triton_cuda_available,
    batch_invariant=True,
)  # fmt: skip

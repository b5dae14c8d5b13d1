"""deepinfer-kernels: every op DeepSeek V4 / V4.1 inference needs, each with a plain-PyTorch
reference that defines correct, plus GPU backends chosen through ``registry``.

The op index (one import per public op):
"""

from deepinfer_kernels.ops._triton_launch import without_early_launch
from deepinfer_kernels.ops.cache_rows import gather_rows, paged_rows, ring_rows, ring_scatter, scatter_rows
from deepinfer_kernels.ops.engram import (
    compressed_token_map,
    engram_compress_ids,
    engram_gate_inject,
    engram_gather_rows,
    engram_hash_ids,
    engram_multipliers,
    engram_next_history,
    engram_rows_in_place,
    engram_table_primes,
)
from deepinfer_kernels.ops.fp8_gemm import (
    Fp8Activations,
    fp8_gemm_activations,
    fp8_gemm_nt,
    quantize_fp8_activations,
)
from deepinfer_kernels.ops.grouped_gemm import grouped_gemm, grouped_gemm_gather
from deepinfer_kernels.ops.grouped_linear import grouped_linear
from deepinfer_kernels.ops.indexer import candidate_block_mask, indexer_scores, indexer_scores_paged, indexer_topk
from deepinfer_kernels.ops.kv_compress import kv_compress_pool, kv_compress_pool_rows, overlap_windows
from deepinfer_kernels.ops.l2_prefetch import l2_prefetch
from deepinfer_kernels.ops.linear import ROW_TILE, linear
from deepinfer_kernels.ops.linear_many import linear_many
from deepinfer_kernels.ops.mhc import (
    MhcConfig,
    MhcParams,
    mhc_coefficients,
    mhc_collapse,
    mhc_collapse_rms_norm,
    mhc_expand,
    mhc_expand_collapse,
    mhc_head_weights,
    mhc_initial_pre_mix,
    mhc_lagged_layer,
    mhc_lagged_site,
    mhc_pre_collapse_rms_norm,
    mhc_same_site_sublayer,
)
from deepinfer_kernels.ops.moe import (
    Mxfp4Experts,
    moe_experts,
    moe_route_hash,
    moe_route_topk,
    swiglu_clamp,
    swiglu_mlp,
)
from deepinfer_kernels.ops.moe_permute import moe_permute, moe_sort, moe_sort_rows, moe_unpermute
from deepinfer_kernels.ops.mxfp4_grouped_gemm import mxfp4_grouped_gemm, mxfp4_grouped_gemm_gather
from deepinfer_kernels.ops.quant import (
    act_dequant_fp8,
    act_quant_fp8,
    e2m1_round,
    fake_quant_e2m1,
    fake_quant_fp8_ue8m0,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
)
from deepinfer_kernels.ops.rms_norm import rms_norm
from deepinfer_kernels.ops.rms_norm_rope import rms_norm_rope
from deepinfer_kernels.ops.rope import YarnScaling, rope_interleaved, rope_inv_freq
from deepinfer_kernels.ops.sparse_mqa_attention import sparse_mqa_attention
from deepinfer_kernels.ops.token_bitmask import apply_token_bitmask
from deepinfer_kernels.ops.topk_select import topk_select

__version__ = "0.1.0"

__all__ = [
    "rms_norm",
    "rms_norm_rope",
    "rope_interleaved",
    "rope_inv_freq",
    "YarnScaling",
    "sparse_mqa_attention",
    "kv_compress_pool",
    "kv_compress_pool_rows",
    "overlap_windows",
    "gather_rows",
    "paged_rows",
    "ring_rows",
    "ring_scatter",
    "scatter_rows",
    "grouped_linear",
    "grouped_gemm",
    "grouped_gemm_gather",
    "MhcConfig",
    "MhcParams",
    "mhc_coefficients",
    "mhc_collapse",
    "mhc_collapse_rms_norm",
    "mhc_expand",
    "mhc_expand_collapse",
    "mhc_head_weights",
    "mhc_initial_pre_mix",
    "mhc_lagged_layer",
    "mhc_lagged_site",
    "mhc_pre_collapse_rms_norm",
    "mhc_same_site_sublayer",
    "moe_experts",
    "Mxfp4Experts",
    "moe_route_hash",
    "moe_route_topk",
    "swiglu_clamp",
    "swiglu_mlp",
    "indexer_scores",
    "indexer_scores_paged",
    "indexer_topk",
    "candidate_block_mask",
    "fp8_block_quantize",
    "fp8_block_dequantize",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "act_quant_fp8",
    "act_dequant_fp8",
    "e2m1_round",
    "fake_quant_fp8_ue8m0",
    "fake_quant_e2m1",
    "compressed_token_map",
    "engram_compress_ids",
    "engram_gate_inject",
    "engram_gather_rows",
    "engram_hash_ids",
    "engram_multipliers",
    "engram_next_history",
    "engram_rows_in_place",
    "engram_table_primes",
    "l2_prefetch",
    "linear",
    "linear_many",
    "ROW_TILE",
    "apply_token_bitmask",
    "Fp8Activations",
    "fp8_gemm_activations",
    "fp8_gemm_nt",
    "quantize_fp8_activations",
    "moe_permute",
    "moe_sort",
    "moe_sort_rows",
    "moe_unpermute",
    "mxfp4_grouped_gemm",
    "mxfp4_grouped_gemm_gather",
    "topk_select",
    "without_early_launch",
]

from deepinfer_kernels.ops.sampling import (  # noqa: E402
    DRAFT_SEED_OFFSET,
    SAMPLING_EPS,
    accept_uniforms,
    apply_penalties,
    draw_tokens,
    log_softmax_rows,
    process_logits,
    processed_logprobs,
    sample_tokens,
    sampling_uniforms,
    seed_to_int64,
    topk_logprobs,
)

__all__ += [
    "DRAFT_SEED_OFFSET",
    "SAMPLING_EPS",
    "accept_uniforms",
    "apply_penalties",
    "draw_tokens",
    "log_softmax_rows",
    "process_logits",
    "processed_logprobs",
    "sample_tokens",
    "sampling_uniforms",
    "seed_to_int64",
    "topk_logprobs",
]

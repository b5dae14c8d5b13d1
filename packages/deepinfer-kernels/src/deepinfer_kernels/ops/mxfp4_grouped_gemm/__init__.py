"""MoE expert GEMMs with MXFP4 weights (E2M1 codes, one UE8M0 scale per 32 along K), bf16 activations.

Hopper has no FP4 tensor cores: the GPU backends dequantise weight tiles to bf16 in registers (exact: an E2M1
value times a power of two fits bf16) and multiply on the bf16 tensor cores with fp32 accumulation.

Two row layouts:

* ``mxfp4_grouped_gemm`` (prefill, "contiguous"): rows sorted by expert (``moe_permute``), expert e owns rows
  [expert_offsets[e], expert_offsets[e+1]), read from x in that order or through ``row_index`` (the gate/up GEMM
  reads the token-major input through the sort's row tokens);
* ``mxfp4_grouped_gemm_gather`` (decode): each output row p names its expert ``row_expert[p]`` and optionally
  its input row ``row_index[p]`` (so the gate/up GEMM reads x[token] straight from the token-major input).

Both can fuse the clamped SwiGLU of ``swiglu_clamp`` into the gate/up projection (w13 = [gate; up] rows, as
in ``moe_experts``) and multiply a per-row scale (the routing weight) into the result.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.grouped_tiles import check_contiguous_rows, check_gather_rows, check_row_vector
from deepinfer_kernels.ops.quant.formats import UE8M0_DTYPES
from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_weights(op: str, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, fuse_swiglu: bool) -> None:
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(f"{op}: x must be a 2-D bfloat16/float16/float32 tensor, got {x.dtype}{tuple(x.shape)}")
    if w.dim() != 3 or w.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{op}: w must be [E, N, K/2] int8/uint8 (packed E2M1), got {w.dtype}{tuple(w.shape)}")
    e, n, kh = w.shape
    if 2 * kh != x.shape[1] or x.shape[1] % 32:
        raise ValueError(
            f"{op}: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (K = 2 * w.shape[2], K % 32 == 0)"
        )
    if w_scale.dtype not in UE8M0_DTYPES or tuple(w_scale.shape) != (e, n, kh // 16):
        raise ValueError(
            f"{op}: w_scale must be [{e}, {n}, {kh // 16}] float8_e8m0fnu/uint8, got {tuple(w_scale.shape)}"
        )
    if fuse_swiglu and n % 2:
        raise ValueError(f"{op}: fuse_swiglu needs an even N (gate rows then up rows), got {n}")


def mxfp4_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    fuse_swiglu: bool = False,
    swiglu_limit: float | None = None,
    row_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Contiguous grouped GEMM: for every expert e and row r in [off[e], off[e+1]): y[r] = x[r] . W_e^T, where
    W_e[n, k] = E2M1(code) * 2^(w_scale[e, n, k // 32] - 127) (``mxfp4_dequantize``), in fp32; with
    ``row_index``, x[row_index[r]] instead of x[r] (the gate/up GEMM reads the token-major input through the
    sort's row tokens, without a sorted copy of it).

    Then, with ``fuse_swiglu``: h[r] = swiglu_clamp(y[r, :N/2], y[r, N/2:], swiglu_limit) (gate = first half of
    the rows of W, up = second half, as ``moe_experts``' w13); then h[r] *= row_scale[r] when given.

    Args:
        x: [R, K] bfloat16 (float16 / float32 accepted; GPU backends round the operand to bf16), rows sorted
            by expert; K a multiple of 32. With ``row_index``: [R_in, K], any row order.
        w: [E, N, K/2] int8/uint8, element 2k in the low nibble of byte k (``mxfp4_quantize`` per expert).
        w_scale: [E, N, K/32] float8_e8m0fnu or uint8 (UE8M0 bytes).
        expert_offsets: [E + 1] integer, non-decreasing, off[0] = 0, off[E] = R (``moe_permute``). Not
            validated on the device (that would synchronise); rows outside [0, off[E]) are left unwritten.
        row_index: [R] integer rows of x in [0, R_in) (not validated on the device), or None (R = x's rows).
        fuse_swiglu: apply the clamped SwiGLU (N even); swiglu_limit: its clamp (10.0 for V4.1) or None.
        row_scale: [R] floating point per-row factor (the routing weight of the row's (token, expert) pair).
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [R, N] (or [R, N/2] with ``fuse_swiglu``) in ``out_dtype``, in sorted-row order. Rows are independent
        (batch-invariant GPU backends use a tiling that does not depend on R or on the offsets).
    """
    op = "mxfp4_grouped_gemm"
    _check_weights(op, x, w, w_scale, fuse_swiglu)
    if row_index is not None and row_index.dim() != 1:
        raise ValueError(f"{op}: row_index must be integer [R], got {row_index.dtype}{tuple(row_index.shape)}")
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    check_row_vector(op, row_index, "row_index", rows, integer=True)
    check_contiguous_rows(op, expert_offsets, w.shape[0], row_scale, rows)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    extra = {"row_index": row_index} if row_index is not None else {}  # a backend without it serves None
    return dispatch(
        op, x.device, x, w, w_scale, expert_offsets,
        fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale, out_dtype=out_dtype, **extra,
    )  # fmt: skip


def mxfp4_grouped_gemm_gather(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    row_expert: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    rows_per_input: int = 1,
    fuse_swiglu: bool = False,
    swiglu_limit: float | None = None,
    row_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Gathered (decode) layout: y[p] = x[row_index[p]] . W_{row_expert[p]}^T (row_index None: x[p //
    rows_per_input]), with the same dequantisation, fused SwiGLU and row scale as ``mxfp4_grouped_gemm``.

    For top-k routing of T tokens: gate/up with row_expert = experts.flatten(), rows_per_input = k (what row_index
    = arange(T*k) // k reads, without building it), row_scale = weights.flatten(); down projection with neither;
    then sum each token's k rows (``moe_unpermute`` with the identity order, or a reshape [T, k, d] and a sum
    over k in slot order).

    Args:
        x: [R_in, K] bfloat16 (float16 / float32 accepted).
        w, w_scale: as ``mxfp4_grouped_gemm``.
        row_expert: [P] integer expert ids in [0, E) (not validated on the device).
        row_index: [P] integer rows of x in [0, R_in), or None (then P = R_in * rows_per_input).
        rows_per_input: consecutive rows of y per row of x when row_index is None (1 with a row_index).
        fuse_swiglu, swiglu_limit, row_scale ([P]), out_dtype: as ``mxfp4_grouped_gemm``.

    Returns:
        [P, N] (or [P, N/2] with ``fuse_swiglu``) in ``out_dtype``; each row computed on its own.
    """
    op = "mxfp4_grouped_gemm_gather"
    _check_weights(op, x, w, w_scale, fuse_swiglu)
    if not isinstance(rows_per_input, int) or rows_per_input < 1 or (row_index is not None and rows_per_input != 1):
        raise ValueError(f"{op}: rows_per_input must be a positive int, and 1 with a row_index, got {rows_per_input!r}")
    check_gather_rows(op, row_expert, row_index, row_scale, x.shape[0] * rows_per_input)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    extra = {"rows_per_input": rows_per_input} if rows_per_input != 1 else {}  # a backend without it serves 1
    return dispatch(
        op, x.device, x, w, w_scale, row_expert,
        row_index=row_index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale,
        out_dtype=out_dtype, **extra,
    )  # fmt: skip


try:  # GPU backends register themselves when Triton imports
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass
try:  # the decode kernels in Gluon (Triton >= 3.4)
    from . import gluon as _gluon  # noqa: F401
except ImportError:
    pass

__all__ = ["mxfp4_grouped_gemm", "mxfp4_grouped_gemm_gather"]

"""MoE expert GEMMs with dense expert stacks (bf16 or fp32 weights [E, N, K]), fp32 accumulation.

The same two row layouts as ``mxfp4_grouped_gemm``:

* ``grouped_gemm`` (prefill, "contiguous"): rows sorted by expert (``moe_permute``), expert e owns rows
  [expert_offsets[e], expert_offsets[e+1]); one launch for all experts;
* ``grouped_gemm_gather`` (decode): each output row p names its expert ``row_expert[p]`` and optionally its
  input row ``row_index[p]`` (so the gate/up GEMM reads x[token] straight from the token-major input).

Both can fuse the clamped SwiGLU of ``swiglu_clamp`` into the gate/up projection (w13 = [gate; up] rows, as
in ``moe_experts``) and multiply a per-row scale (the routing weight) into the result.

Products are exact: the result is the fp32 math of the reference on the upcast values of x and W, up to the
order of the fp32 sums. bf16 weights meet bf16 activations on the bf16 tensor cores (a bf16 x bf16 product is
exact in fp32); float16 / float32 activations are split exactly into two / three bf16 terms (hi + mid + lo)
that each meet the same weight tile, so they are never rounded to bf16. fp32 weights use IEEE fp32 products
(no TF32).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ops.grouped_tiles import check_contiguous_rows, check_gather_rows, check_row_vector
from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_W_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(op: str, x: torch.Tensor, w: torch.Tensor, fuse_swiglu: bool, out_dtype: torch.dtype) -> None:
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(f"{op}: x must be a 2-D bfloat16/float16/float32 tensor, got {x.dtype}{tuple(x.shape)}")
    if w.dim() != 3 or w.dtype not in _W_DTYPES:
        raise ValueError(f"{op}: w must be [E, N, K] bfloat16/float32, got {w.dtype}{tuple(w.shape)}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (K = w.shape[2])")
    if fuse_swiglu and w.shape[1] % 2:
        raise ValueError(f"{op}: fuse_swiglu needs an even N (gate rows then up rows), got {w.shape[1]}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    fuse_swiglu: bool = False,
    swiglu_limit: float | None = None,
    row_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Contiguous grouped GEMM: for every expert e and row r in [off[e], off[e+1]): y[r] = x[r] . W_e^T in fp32
    (x[row_index[r]] with ``row_index``).

    Then, with ``fuse_swiglu``: h[r] = swiglu_clamp(y[r, :N/2], y[r, N/2:], swiglu_limit) (gate = first half of
    the rows of W, up = second half, as ``moe_experts``' w13); then h[r] *= row_scale[r] when given.

    Args:
        x: [R, K] bfloat16 / float16 / float32, rows sorted by expert. Never rounded: see the module docstring.
            With ``row_index``: [R_in, K] in any row order (token-major: the MoE input as it is).
        row_index: None, or [R] integer rows of x in [0, R_in) (not validated on the device): row r of the sorted
            layout reads x[row_index[r]], so a prefill's gate/up GEMM reads the tokens in place instead of a
            sorted copy of them (``moe_permute``'s x[order // k]: R x K more bytes written and read). Same bits as
            the sorted copy.
        w: [E, N, K] bfloat16 or float32 (``moe_experts``' w13 [E, 2I, d] or w2 [E, d, I]).
        expert_offsets: [E + 1] integer, non-decreasing, off[0] = 0, off[E] = R (``moe_permute``). Not
            validated on the device (that would synchronise); rows outside [0, off[E]) are left unwritten.
        fuse_swiglu: apply the clamped SwiGLU (N even); swiglu_limit: its clamp (10.0 for V4 / V4.1) or None.
        row_scale: [R] floating point per-row factor (the routing weight of the row's (token, expert) pair).
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        [R, N] (or [R, N/2] with ``fuse_swiglu``) in ``out_dtype``. Rows are independent: a row's bits do not
        depend on R or on the offsets (batch-invariant), and it gets the same bits here as through
        ``grouped_gemm_gather``.
    """
    op = "grouped_gemm"
    _check(op, x, w, fuse_swiglu, out_dtype)
    rows = row_index.shape[0] if row_index is not None and row_index.dim() == 1 else x.shape[0]
    check_row_vector(op, row_index, "row_index", rows, integer=True)
    check_contiguous_rows(op, expert_offsets, w.shape[0], row_scale, rows)
    kw = {} if row_index is None else {"row_index": row_index}  # backends without row_index still serve the rest
    return dispatch(
        op, x.device, x, w, expert_offsets,
        fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale, out_dtype=out_dtype, **kw,
    )  # fmt: skip


def grouped_gemm_gather(
    x: torch.Tensor,
    w: torch.Tensor,
    row_expert: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    fuse_swiglu: bool = False,
    swiglu_limit: float | None = None,
    row_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Gathered (decode) layout: y[p] = x[row_index[p]] . W_{row_expert[p]}^T (row_index None: x[p]) in fp32,
    with the same fused SwiGLU and row scale as ``grouped_gemm``.

    For top-k routing of T tokens: gate/up with row_expert = experts.flatten(), row_index = arange(T*k) // k,
    row_scale = weights.flatten(); down projection with row_index None; then sum each token's k rows
    (``moe_unpermute`` with the identity order).

    Args:
        x: [R_in, K] bfloat16 / float16 / float32.
        w: as ``grouped_gemm``.
        row_expert: [P] integer expert ids in [0, E) (not validated on the device).
        row_index: [P] integer rows of x in [0, R_in), or None (then P = R_in).
        fuse_swiglu, swiglu_limit, row_scale ([P]), out_dtype: as ``grouped_gemm``.

    Returns:
        [P, N] (or [P, N/2] with ``fuse_swiglu``) in ``out_dtype``; each row computed on its own, with the
        same bits as the same row through ``grouped_gemm``.
    """
    op = "grouped_gemm_gather"
    _check(op, x, w, fuse_swiglu, out_dtype)
    check_gather_rows(op, row_expert, row_index, row_scale, x.shape[0])
    return dispatch(
        op, x.device, x, w, row_expert,
        row_index=row_index, fuse_swiglu=fuse_swiglu, swiglu_limit=swiglu_limit, row_scale=row_scale,
        out_dtype=out_dtype,
    )  # fmt: skip


try:  # GPU backends register themselves when Triton imports
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

__all__ = ["grouped_gemm", "grouped_gemm_gather"]

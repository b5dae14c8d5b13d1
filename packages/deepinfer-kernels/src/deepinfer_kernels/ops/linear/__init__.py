"""Row-invariant dense linear map ``y = x W^T`` (no bias): the matrix multiply every other
reference builds on, so that a full forward and an incremental decode agree bit for bit."""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)
from .reference import ROW_TILE


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y[..., n] = sum_k x[..., k] * weight[n, k], computed in x.dtype (or fp32 with ``out_dtype``).

    Contract: each output row depends only on its own input row (row-invariant), bitwise, for a
    given weight: the result for a row is the same whatever other rows are in the call (their
    number, their order, how a sequence is chunked), so a full forward and an incremental decode
    agree exactly. Backends must keep this property (batch-invariant mode); plain
    ``F.linear`` on the CPU does not (its result for a row changes with the number of rows).

    Args:
        x: [..., K] any float dtype (flattened to rows; any number of leading dims, or none).
        weight: [N, K], cast to x.dtype before the product (pass an fp32 x with an fp32 weight
            for an fp32 computation; a bf16 weight with an fp32 x is upcast, exactly).
        out_dtype: None, or torch.float32: the same function as ``linear(x.float(), weight.float())`` (products of
            the stored values, exact in fp32, summed in fp32; fp32 result), which GPU backends compute without
            fp32 copies of x and weight when both are bf16 / fp16 (one tensor-core GEMM writing fp32: the LM head,
            routers and compressor projections of decisions C3).

    Returns:
        [..., N] in x.dtype (fp32 with ``out_dtype``). Empty inputs give empty outputs. The reference computes
        in fixed tiles of ``ROW_TILE`` rows (the last tile zero-padded); see reference.py.
    """
    if weight.dim() != 2 or x.dim() < 1 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit ([..., K] x [N, K])")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"linear: x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"linear: out_dtype must be None or torch.float32, got {out_dtype}")
    a, w, dt = backend_args(x, weight, out_dtype)
    return dispatch("linear", x.device, a, w) if dt is None else dispatch("linear", x.device, a, w, out_dtype=dt)


def backend_args(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype | None]:
    """The (x, weight, out_dtype) a ``linear`` backend computes a checked call with: an fp32 x already computes in
    fp32 (the weight upcast), mixed low precisions upcast both (no single tensor-core GEMM; exact), else out_dtype
    as asked (None or fp32)."""
    if out_dtype is None or x.dtype == torch.float32:
        return x, weight, None
    if weight.dtype != x.dtype:
        return x.float(), weight.float(), None
    return x, weight, torch.float32


from . import cublas as _cublas  # noqa: E402,F401  (registers the CUDA backend)

try:  # the Triton backends register themselves on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: E402,F401
    from . import triton_skinny as _triton_skinny  # noqa: E402,F401
except ImportError:
    pass

__all__ = ["ROW_TILE", "linear"]

"""Several dense linear maps of one input: ``[linear(x, w, dt) for w, dt in zip(weights, out_dtypes)]`` as one op,
so that a backend can stream every weight in one launch (a decode step's projections of one normed hidden state:
the query / key-value / compressor / indexer projections of an attention layer, a shared expert's gate and up)."""

from collections.abc import Sequence

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference and the per-weight loop)


def linear_many(
    x: torch.Tensor, weights: Sequence[torch.Tensor], out_dtypes: Sequence[torch.dtype | None] | None = None
) -> list[torch.Tensor]:
    """y_i[..., n] = sum_k x[..., k] * weights[i][n, k] for every weight: exactly ``linear(x, weights[i],
    out_dtypes[i])`` each (same contract: row-invariant per backend in batch-invariant mode, x.dtype or fp32 out).

    Args:
        x: [..., K] floating point.
        weights: one or more [N_i, K] floating-point matrices (any N_i).
        out_dtypes: None (every output in x.dtype), or one entry per weight: None or torch.float32.

    Returns:
        list of [..., N_i], in x.dtype or fp32 as asked.
    """
    weights = list(weights)
    if not weights:
        raise ValueError("linear_many: needs at least one weight")
    dtypes = [None] * len(weights) if out_dtypes is None else list(out_dtypes)
    if len(dtypes) != len(weights):
        raise ValueError(f"linear_many: {len(weights)} weights but {len(dtypes)} out_dtypes")
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"linear_many: x must be a floating-point [..., K] tensor, got {x.dtype} {tuple(x.shape)}")
    for i, (w, dt) in enumerate(zip(weights, dtypes)):
        if w.dim() != 2 or w.shape[1] != x.shape[-1] or not w.is_floating_point():
            raise ValueError(
                f"linear_many: weight {i} {tuple(w.shape)} {w.dtype} does not fit x {tuple(x.shape)} "
                "(floating point [N, K])"
            )
        if dt not in (None, torch.float32):
            raise ValueError(f"linear_many: out_dtypes[{i}] must be None or torch.float32, got {dt}")
    return dispatch("linear_many", x.device, x, weights, dtypes)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import triton as _triton  # noqa: E402,F401
except ImportError:
    pass

__all__ = ["linear_many"]

"""General top-k selection of fp32 scores: ascending indices, -1 padded, deterministic ties.

The building block of ``indexer_topk`` (k = 512 of up to N compressed entries per query) and of any
other "pick the k best of N" step. Unlike ``indexer_topk`` (ties unspecified), this op fixes the tie
rule, so every backend returns bitwise the same index set as the reference.
"""

import torch

from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the reference)

try:  # the Triton backend registers itself on import; triton is optional
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass


def topk_select(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of the ``k`` largest selectable scores of each row, ascending, then -1 padding.

    Selectable: n < lengths[s] (clamped to [0, N]; all of the row when ``lengths`` is None), mask[s, n]
    (when given) and the score is neither NaN nor -inf (so callers may also mask entries by writing -inf;
    ``mask`` spares them that pass over the scores).

    Ties (contract): entries are ranked by (score descending, index ascending), so among equal scores
    the lower index wins; -0.0 and +0.0 are equal. The selection is therefore unique: every backend
    must return exactly the reference's indices.

    Output: row s holds the min(k, #selectable) chosen indices in ascending order, then -1 up to the
    width min(k, N).

    Args:
        scores: [S, N] fp32, last dim contiguous (row stride free).
        k: int >= 0 (the V4 / V4.1 indexer: 512).
        lengths: optional [S] int64 per-row valid prefix lengths (the indexer's ``visible``).
        mask: optional bool [S, N] (last dim contiguous), False: not selectable (V4.1's candidate blocks).

    Returns:
        [S, min(k, N)] int64 on scores' device. See reference.py.
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"topk_select: scores must be fp32 [S, N], got {scores.dtype}{tuple(scores.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"topk_select: k must be an int >= 0, got {k!r}")
    if lengths is not None and (lengths.shape != scores.shape[:1] or lengths.dtype != torch.int64):
        raise ValueError(
            f"topk_select: lengths must be int64 [S={scores.shape[0]}], got {lengths.dtype}{tuple(lengths.shape)}"
        )
    if mask is not None and (mask.shape != scores.shape or mask.dtype != torch.bool or mask.device != scores.device):
        raise ValueError(
            f"topk_select: mask must be bool {tuple(scores.shape)} on {scores.device}, got {mask.dtype}"
            f"{tuple(mask.shape)} on {mask.device}"
        )
    return dispatch("topk_select", scores.device, scores, k, lengths, mask)

"""Plain-PyTorch top-k selection with the (score desc, index asc) tie rule (the definition of correct).

A stable descending sort keeps equal scores in index order, so its first k entries are exactly the
contract's picks. Row-invariant: each row is sorted on its own.
"""

import torch

from deepinfer_kernels.registry import register_reference


@register_reference("topk_select")
def topk_select_ref(
    scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    s, n = scores.shape
    width = min(k, n)
    if width == 0 or s == 0:
        return torch.full((s, width), -1, dtype=torch.int64, device=scores.device)
    keep = ~scores.isnan() & (scores != float("-inf"))
    if lengths is not None:
        entry = torch.arange(n, device=scores.device)
        keep &= entry < lengths.to(scores.device).clamp(0, n).unsqueeze(-1)
    if mask is not None:
        keep &= mask
    # + 0.0 turns -0.0 into +0.0 (IEEE), so signed zeros tie like the contract says
    masked = torch.where(keep, scores + 0.0, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :width]
    real = torch.gather(keep, 1, order)
    picks = torch.where(real, order, n).sort(dim=-1).values  # parked non-picks sort last
    return torch.where(picks == n, -1, picks)

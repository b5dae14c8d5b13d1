"""Row exchange of the CP prefill: each CP rank holds the rows of some positions; gather them in sequence order."""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepinfer_parallel._comm import all_gather_rows


def gather_in_order(x_local: torch.Tensor, owned: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank's rows, in ascending position order (collective over ``group``; bitwise, any dtype).

    Args:
        x_local: [n_r, ...] this rank's rows, at positions ``owned[rank]`` (ascending).
        owned: per CP rank (group order), [n_q] int64 positions of its rows; known to every rank without
            communication (the zigzag assignment, possibly filtered the same way on every rank).

    Returns:
        [sum n_q, ...] rows sorted by position.
    """
    parts = all_gather_rows(x_local, group)
    order = torch.argsort(torch.cat(owned), stable=True).to(x_local.device)
    return torch.cat(parts)[order]

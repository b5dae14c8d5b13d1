"""Plain-PyTorch row-invariant linear (the definition of correct).

``F.linear`` / ``matmul`` on the CPU pick their kernel (and blocking) from the number of rows M:
M = 1 takes a gemv path and larger M different GEMM blockings, so the bits of one row change with
the batch it travels in. Computing every call as a sequence of fixed-shape [ROW_TILE, K] x [K, N]
products removes the dependence: a row's result depends on its own values and on (K, N, weight)
only, never on its position in the tile or on the other rows. The last tile is zero-padded.

Other references import ``linear_ref`` directly (not the dispatching ``linear``) so that forcing
references keeps the whole model row-invariant.

Fixed shapes are not enough on a many-core host: MKL's GEMM also chooses its path from the operands' addresses
and the thread split, so with 16 threads a row's bits still changed with the other rows of its tile (seen on
the H200 host; 2-8 threads were invariant). MKL's conditional numerical reproducibility in strict mode
(``MKL_CBWR=AUTO,STRICT``) removes that; MKL reads the variable at its first call, so it is set here, at
import, unless the user set it.
"""

import os

import torch
import torch.nn.functional as F

from deepinfer_kernels.registry import register_reference

ROW_TILE = 16
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


@register_reference("linear")
def linear_ref(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is not None:  # fp32 products of the stored values: upcasting first is exact
        x = x.to(out_dtype)
    k = x.shape[-1]
    n = weight.shape[0]
    w = weight.to(x.dtype)
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        pad = -m % ROW_TILE
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, k)])
        for start in range(0, m, ROW_TILE):
            stop = min(start + ROW_TILE, m)
            out[start:stop] = F.linear(rows[start : start + ROW_TILE], w)[: stop - start]
    return out.reshape(*x.shape[:-1], n)

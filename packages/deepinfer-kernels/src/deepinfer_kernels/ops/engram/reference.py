"""Plain-PyTorch Engram n-gram hashing and gated injection (the definition of correct)."""

import math

import torch

from deepinfer_kernels.ops._elementwise import sigmoid
from deepinfer_kernels.ops._reduce import row_mean, row_sum
from deepinfer_kernels.ops.quant.formats import is_ue8m0, ue8m0_bytes_to_float
from deepinfer_kernels.registry import register_reference

from .vocab import DEAD


@register_reference("engram_hash_ids")
def engram_hash_ids_ref(
    compressed: torch.Tensor,
    history: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    pad_id: int,
) -> torch.Tensor:
    device = compressed.device
    batch, seq = compressed.shape
    max_ngram = multipliers.numel()
    lookback = max_ngram - 1
    n_heads = primes.numel() // lookback
    if history is None:
        history = torch.full((batch, lookback), DEAD, dtype=torch.int64, device=device)
    # ext[:, lookback + t] is chunk position t; ext[:, lookback + t - s] is the token s back.
    ext = torch.cat([history.to(device=device, dtype=torch.int64), compressed.to(torch.int64)], dim=1)
    mult = multipliers.to(device=device, dtype=torch.int64)
    primes = primes.to(device=device, dtype=torch.int64)
    offsets = torch.cumsum(primes, 0) - primes

    g = torch.zeros(batch, seq, dtype=torch.int64, device=device)
    blocked = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    cols = []
    for s in range(max_ngram):
        tok = ext[:, lookback - s : lookback - s + seq]
        blocked = blocked | (tok < 0)  # once blocked (before the start, or DEAD), pad from here on
        v = torch.where(blocked, torch.full_like(tok, pad_id), tok)
        g = g ^ (v * mult[s])  # int64; v < C and M[s] < (2^63-1)/C, so never negative
        if s >= 1:
            sl = slice((s - 1) * n_heads, s * n_heads)
            cols.append(g.unsqueeze(-1) % primes[sl] + offsets[sl])
    return torch.cat(cols, dim=-1)


@register_reference("engram_gate_inject")
def engram_gate_inject_ref(
    x: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    w: torch.Tensor,
    image_mask: torch.Tensor | None,
    eps: float = 1e-20,
) -> torch.Tensor:
    xf = x.float()
    kf = key.float()
    d = x.shape[-1]
    xn = xf * torch.rsqrt(row_mean(xf.square()) + eps)  # per stream, not jointly
    kn = kf * torch.rsqrt(row_mean(kf.square()) + eps)
    dot = row_sum(xn * w.float() * kn).squeeze(-1) / math.sqrt(d)  # [..., n]
    # the row-invariant sigmoid: torch.sigmoid's bits depend on the other rows in the call (CPU)
    gate = sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    if image_mask is not None:
        gate = gate.masked_fill(image_mask.to(torch.bool).unsqueeze(-1), 0.0)
    return (xf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)


@register_reference("engram_gather_rows")
def engram_gather_rows_ref(
    rows: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Gather where the table lives (ids go there: a host table waits for the device), dequantise in fp32."""
    flat = ids.reshape(-1).to(rows.device)
    got = rows[flat].float()
    if scale is not None:
        s = scale[flat]
        s = ue8m0_bytes_to_float(s) if is_ue8m0(s) else s.float()
        got = got * s.repeat_interleave(rows.shape[1] // s.shape[1], dim=1)
    return got.to(device=ids.device, dtype=out_dtype).view(ids.shape[0], -1)

"""Engram conditional memory (DeepSeek V4.1 layers 1 and 14): n-gram hash row ids and the gated
injection of the looked-up value into the hc streams (spec B.6).

Setup (once, at load)::

    token_map = compressed_token_map(tokenizer_json, expected_size=99092)    # int64 [129280]
    pad_id = int(token_map[2])                                               # engram_pad_token_id
    primes = engram_table_primes(16_000_000, 2, 3, 8)                       # per layer, 24 each
    mults = [engram_multipliers(layer, 99092) for layer in (1, 14)]

Per forward (chunked prefill and decode alike; ``history`` is carried per sequence)::

    comp = engram_compress_ids(input_ids, token_map, image_mask)            # [B, S], DEAD = -1
    rows = [engram_hash_ids(comp, history, M_L, P_L, pad_id) for each layer]  # [B, S, 24] each
    history = engram_next_history(comp, history, 4)
    ... gather + dequantise the 24 rows, kv = wkv(E) -> key [T, 4, d], value [T, d] ...
    x = engram_gate_inject(x, key, value, q_weight * k_weight, image_mask)
"""

import torch

from deepinfer_kernels import registry
from deepinfer_kernels.registry import dispatch

from . import reference as _reference  # noqa: F401  (registers the references)
from .vocab import DEAD, compressed_token_map, engram_multipliers, engram_table_primes

__all__ = [
    "DEAD",
    "compressed_token_map",
    "engram_compress_ids",
    "engram_gate_inject",
    "engram_gather_rows",
    "engram_rows_in_place",
    "engram_hash_ids",
    "engram_multipliers",
    "engram_next_history",
    "engram_table_primes",
]


def engram_compress_ids(
    input_ids: torch.Tensor, token_map: torch.Tensor, image_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw token ids -> compressed ids, with image-span tokens marked DEAD (-1).

    Args:
        input_ids: integer [...] token ids in [0, len(token_map)).
        token_map: int64 [V] from ``compressed_token_map`` (moved to input_ids' device).
        image_mask: bool [...] like input_ids (True inside image spans) or None.

    Returns:
        int64 [...] compressed ids.
    """
    out = token_map.to(input_ids.device)[input_ids.long()]
    if image_mask is not None:
        out = out.masked_fill(image_mask.to(torch.bool), DEAD)
    return out


def engram_hash_ids(
    compressed: torch.Tensor,
    history: torch.Tensor | None,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    pad_id: int,
) -> torch.Tensor:
    """Row ids of one Engram layer's table for every position of a chunk (spec B.6.1 steps 2-7).

    With N = max_ngram, H = N - 1 and v_s(t) the compressed id s positions before t (s = 0..H,
    taken from ``history`` when it falls before the chunk): the lookback is blocked from the
    first s whose slot is before the start of the sequence or DEAD (-1), and every blocked slot
    uses ``pad_id`` instead. The rolling int64 hash is g_0 = v_0 M[0], g_s = g_{s-1} XOR v_s M[s];
    g_s (s >= 1) hashes the (s+1)-gram ending at t. Column c = n_heads (n - 2) + k (n-gram size
    n = 2..N, head k) is ``g_{n-1} mod P[c] + offset[c]`` with offset the exclusive cumulative sum
    of P, so ids of different columns never collide and all lie in [0, sum(P)). A DEAD token
    itself hashes to the all-pad n-grams.

    Args:
        compressed: int64 [B, S] compressed ids in [0, C), or -1 for DEAD (image-span) tokens.
        history: int64 [B, H] compressed ids of the H positions before the chunk, most recent
            last, -1 for "before the sequence start" or DEAD; None = the chunk starts the
            sequence. Use ``engram_next_history`` to carry it from one chunk to the next.
        multipliers: int64 [N] (``engram_multipliers``); every v * M[s] must fit in int64.
        primes: int64 [H * n_heads] this layer's bucket primes in column order
            (``engram_table_primes``).
        pad_id: the compressed id of token ``engram_pad_token_id`` (2), in [0, C).

    Returns:
        int64 [B, S, H * n_heads] row ids on compressed's device (V4.1: [B, S, 24]).
    """
    if compressed.dim() != 2 or compressed.is_floating_point():
        raise ValueError(f"engram_hash_ids: compressed must be integer [B, S], got {compressed.dtype}")
    if multipliers.dim() != 1 or multipliers.numel() < 2:
        raise ValueError(f"engram_hash_ids: multipliers must be [max_ngram >= 2], got {tuple(multipliers.shape)}")
    lookback = multipliers.numel() - 1
    if primes.dim() != 1 or primes.numel() == 0 or primes.numel() % lookback:
        raise ValueError(
            f"engram_hash_ids: primes must be [(max_ngram-1) * n_heads] = [{lookback} * n_heads], "
            f"got {tuple(primes.shape)}"
        )
    if history is not None and tuple(history.shape) != (compressed.shape[0], lookback):
        raise ValueError(
            f"engram_hash_ids: history must be [B, {lookback}] = {(compressed.shape[0], lookback)}, "
            f"got {tuple(history.shape)}"
        )
    if pad_id < 0:
        raise ValueError(f"engram_hash_ids: pad_id must be a compressed id >= 0, got {pad_id}")
    return dispatch("engram_hash_ids", compressed.device, compressed, history, multipliers, primes, pad_id)


def engram_next_history(compressed: torch.Tensor, history: torch.Tensor | None, max_ngram: int = 4) -> torch.Tensor:
    """The ``history`` to pass with the chunk that follows ``compressed``.

    The last max_ngram - 1 entries of [history, compressed] (history None = all -1), so that
    hashing a sequence chunk by chunk (decode: chunks of 1) equals hashing it whole.

    Args:
        compressed: int64 [B, S] compressed ids of this chunk (-1 = DEAD).
        history: int64 [B, max_ngram - 1] or None (this chunk starts the sequence).

    Returns:
        int64 [B, max_ngram - 1], a new tensor.
    """
    lookback = max_ngram - 1
    batch = compressed.shape[0]
    if history is None:
        history = torch.full((batch, lookback), DEAD, dtype=torch.int64, device=compressed.device)
    ext = torch.cat([history.to(device=compressed.device, dtype=torch.int64), compressed.to(torch.int64)], dim=1)
    return ext[:, ext.shape[1] - lookback :].clone()


def engram_gate_inject(
    x: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    w: torch.Tensor,
    image_mask: torch.Tensor | None,
    eps: float = 1e-20,
) -> torch.Tensor:
    """Per-stream gated add of the Engram value into the hc streams (spec B.6.2), in fp32.

    For every token and stream j:
    dot_j = sum_c x_j[c] w_j[c] key_j[c] * rsqrt(mean(x_j^2) + eps) * rsqrt(mean(key_j^2) + eps) / sqrt(d),
    gate_j = sigmoid(sign(dot_j) * sqrt(max(|dot_j|, 1e-6))), with gate_j = 0 on image tokens
    (decision C7), and x_j <- x_j + gate_j * value (the same value for every stream).
    The RMS is taken per stream over d, not jointly. dot_j = 0 gives gate 0.5.

    Args:
        x: [T, n, d] hc streams entering the Engram layer, any float dtype.
        key: [T, n, d] one key per stream (kv rows 0..n-1 of ``engram.wkv``), any float dtype.
        value: [T, d] the shared value (kv row n), any float dtype.
        w: [n, d] ``q_weight * k_weight`` (only the product is used), applied in fp32.
        image_mask: bool [T], True for image-span tokens (their streams pass unchanged), or None.
        eps: rms_norm_eps (V4.1: 1e-20).

    Returns:
        [T, n, d] in x.dtype (fp32 arithmetic, one rounding at the end).
    """
    if x.dim() < 2 or key.shape != x.shape:
        raise ValueError(f"engram_gate_inject: key {tuple(key.shape)} must match x {tuple(x.shape)} = [T, n, d]")
    if value.shape != x.shape[:-2] + x.shape[-1:]:
        raise ValueError(f"engram_gate_inject: value {tuple(value.shape)} must be [T, d] for x {tuple(x.shape)}")
    if w.shape != x.shape[-2:]:
        raise ValueError(f"engram_gate_inject: w {tuple(w.shape)} must be [n, d] = {tuple(x.shape[-2:])}")
    if image_mask is not None and image_mask.shape != x.shape[:-2]:
        raise ValueError(f"engram_gate_inject: image_mask {tuple(image_mask.shape)} must be [T] = {x.shape[:-2]}")
    return dispatch("engram_gate_inject", x.device, x, key, value, w, image_mask, eps)


def engram_gather_rows(
    rows: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The table rows of ``ids``, dequantised: out[t, c * Dh : (c + 1) * Dh] = rows[ids[t, c]] (times its scales).

    The table stays in its stored format wherever it lives: on the device, or in host memory (a 100 GB table);
    only the gathered rows travel. A pinned host table is read in place by the device where a backend can
    (``engram_rows_in_place``), else through the host (which waits for the device).

    Args:
        rows: [R, Dh] float8_e4m3fn (with ``scale``) or a float dtype (``scale`` None).
        scale: [R, Dh / 32] UE8M0 (float8_e8m0fnu or uint8 bytes) per-32 scales, or None.
        ids: int64 [T, C] row ids in [0, R), on the compute device.
        out_dtype: the dtype of the result (dequantised in fp32, then cast).

    Returns:
        [T, C * Dh] ``out_dtype`` on ids' device; bitwise the same on every backend (exact gather and power-of-two
        scaling, one rounding to ``out_dtype``) except where a product is an fp32 subnormal (scale byte 0).
    """
    if rows.dim() != 2 or ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(
            f"engram_gather_rows: need rows [R, Dh] and int64 ids [T, C]; got {tuple(rows.shape)}, "
            f"{tuple(ids.shape)} {ids.dtype}"
        )
    if scale is not None and (scale.shape[0] != rows.shape[0] or scale.shape[1] * 32 != rows.shape[1]):
        raise ValueError(f"engram_gather_rows: scale {tuple(scale.shape)} does not match rows {tuple(rows.shape)}")
    return dispatch("engram_gather_rows", ids.device, rows, scale, ids, out_dtype)


def engram_rows_in_place(rows: torch.Tensor, device: torch.device | str) -> bool:
    """True when ``engram_gather_rows`` on ``device`` reads ``rows`` without the host (no wait for the device, so
    a step can be captured in a CUDA graph): a table on that device, or a pinned host table and a backend that
    reads host memory in place."""
    device = torch.device(device)
    if rows.device.type == device.type:
        return True
    # ``registry.resolve``: in this package the name ``reference`` is the reference submodule
    fn = registry.resolve("engram_gather_rows", device)
    return rows.is_pinned() and getattr(fn, "reads_pinned_host", False)


try:  # the Triton backend registers itself on import; triton is optional (CPU-only installs have none)
    from . import hash_triton as _hash_triton  # noqa: F401
    from . import triton as _triton  # noqa: F401
except ImportError:
    pass

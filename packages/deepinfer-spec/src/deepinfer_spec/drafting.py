"""Procedure D steps 5-6 (decisions section 3): the sequential Markov stage of DSpark drafting, plus
the draft sampler of decision D3. Engine-independent: it starts from the block's base logits and
pre-norm hiddens, which the runtime's DSpark stages produce.

For k = 1 .. N (column k-1), with x_0 the anchor at position a:

* logits_k = U_k + W2 W1[x_{k-1}] (the Markov bias from the previous token), fp32;
* c_k = sigmoid(clamp(w . [h_k ; W1[x_{k-1}]] / T_k, -60, 60)), fp32 (decision D2);
* x_k = the request's own sampler on logits_k (temperature, min-p, top-p, top-k; greedy at T = 1e-5)
  on the draft random stream: seed + ``DRAFT_SEED_OFFSET``, position a+k (decisions D3, B3);
* stored: x_k, the processed log-distribution of logits_k, c_k.

Step 6: a request that emitted EOS or a stop token this step gets confidences 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer_kernels.ops.sampling import DRAFT_SEED_OFFSET, draw_tokens, log_softmax_rows, process_logits

from .protocol import Drafts, ProposeBatch


def draft_seeds(seeds: torch.Tensor) -> torch.Tensor:
    """int64 [B] seq_seed + DRAFT_SEED_OFFSET modulo 2^64 (int64 addition wraps)."""
    return seeds + DRAFT_SEED_OFFSET


def sample_draft(
    logits: torch.Tensor, batch: ProposeBatch, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft per row with the request's own sampler on the draft stream (decision D3).

    Args:
        logits: fp32 [B, V] draft logits for this position.
        batch: the requests' sampling parameters and seeds.
        positions: int64 [B] absolute positions of the drafted tokens (a+k).

    Returns:
        (tokens int64 [B], processed logprobs fp32 [B, V]).
    """
    processed = process_logits(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.greedy)
    tokens = draw_tokens(processed, draft_seeds(batch.seeds), positions)
    return tokens, log_softmax_rows(processed)


def confidence(features: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """c = sigmoid(clamp(features . weight / T, -60, 60)) in fp32 (decision D2).

    Args:
        features: [B, D + R] the pre-norm hidden h_k concatenated with W1[x_{k-1}].
        weight: [D + R] or [1, D + R] the confidence head's projection.
        temperature: T_k (already floored at 1e-5 by ``SpeculativeConfig``).

    Returns:
        fp32 [B].
    """
    z = features.float() @ weight.float().reshape(-1) / temperature
    return torch.sigmoid(z.clamp(-60.0, 60.0))


def markov_drafts(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    markov_embed: torch.Tensor,
    markov_head: torch.Tensor,
    confidence_weight: torch.Tensor | None,
    confidence_temperatures: Sequence[float],
    batch: ProposeBatch,
) -> Drafts:
    """Procedure D steps 5-6 for a batch of blocks.

    Args:
        base_logits: fp32 [B, N, V] U_k = head(norm(h_k)).
        hidden: [B, N, D] the pre-norm hiddens h_k.
        markov_embed: [V, R] W1. markov_head: [V, R] W2 (used as vocab <- rank).
        confidence_weight: [D + R] (or [1, D + R]) w, or None (no confidence head: confidences None).
        confidence_temperatures: one T for all positions, or N values.
        batch: anchors, anchor positions, seeds, sampling parameters, stopped flags.

    Returns:
        ``Drafts`` with tokens [B, N], logprobs [B, N, V], confidences [B, N] (or None).
    """
    b, n, _ = base_logits.shape
    temps = list(confidence_temperatures)
    if len(temps) not in (1, n):
        raise ValueError(f"markov_drafts: need 1 or N = {n} confidence temperatures, got {len(temps)}")
    w2 = markov_head.float()
    prev = batch.anchors.long()
    toks, lps, confs = [], [], []
    for k in range(n):
        m = markov_embed[prev].float()  # [B, R]
        logits_k = base_logits[:, k].float() + m @ w2.t()
        if confidence_weight is not None:
            t = temps[0] if len(temps) == 1 else temps[k]
            confs.append(confidence(torch.cat([hidden[:, k].float(), m], 1), confidence_weight, t))
        prev, lp = sample_draft(logits_k, batch, batch.anchor_positions + k + 1)
        toks.append(prev)
        lps.append(lp)
    conf = None
    if confidence_weight is not None:
        conf = torch.stack(confs, 1)
        conf = torch.where(batch.stopped.unsqueeze(1), torch.zeros_like(conf), conf)  # step 6
    return Drafts(torch.stack(toks, 1), torch.stack(lps, 1), conf)

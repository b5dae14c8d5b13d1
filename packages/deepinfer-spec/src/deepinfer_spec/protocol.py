"""The proposer contract: what the engine hands a draft proposer and what it gets back.

A proposer (the V4.1 DSpark head, V4-Flash's MTP layer, V4-Flash-0731's DSpark head) turns each
request's anchor (the token the last target step emitted, at position a) into up to N drafts for
positions a+1 .. a+N, sampled with the request's own processed distribution on the draft random
stream (decisions D3, B3: seed + ``DRAFT_SEED_OFFSET``, position a+k for draft k). It returns a
``Drafts`` record; verification (``rejection.py`` / ``block_verify.py``) reads only that record.

The runtime's ``DeepseekV41ForCausalLM.draft_block`` returns ``DraftBlock(tokens, confidences, logprobs)``
with exactly these shapes; ``Drafts.from_block`` adapts it (or anything with the same attributes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Drafts:
    """One block of drafts per request (row b of every tensor is request b).

    Attributes:
        tokens: int64 [B, N] draft ids; d_k = tokens[:, k-1] is the token proposed for position a+k.
            -1 marks a missing draft (always rejected by verification).
        logprobs: fp32 [B, N, V] the *processed* draft log-distribution each draft was sampled from
            (temperature / top-p / top-k applied, -inf where filtered; decision D3). Verification uses
            p_k = exp(logprobs[:, k-1]).
        confidences: fp32 [B, N] c_k in [0, 1] (decision D2), or None for a proposer without a
            confidence head (procedure S then counts 1.0 per draft).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    confidences: torch.Tensor | None = None

    def __post_init__(self) -> None:
        t, lp, c = self.tokens, self.logprobs, self.confidences
        if t.dim() != 2 or t.dtype != torch.int64:
            raise ValueError(f"Drafts.tokens must be int64 [B, N], got {t.dtype}{tuple(t.shape)}")
        if lp.dim() != 3 or lp.shape[:2] != t.shape or lp.dtype != torch.float32:
            raise ValueError(
                f"Drafts.logprobs must be fp32 [B, N, V] with [B, N] = {tuple(t.shape)}, "
                f"got {lp.dtype}{tuple(lp.shape)}"
            )
        if c is not None and (c.shape != t.shape or c.dtype != torch.float32):
            raise ValueError(f"Drafts.confidences must be fp32 {tuple(t.shape)} or None, got {c.dtype}{tuple(c.shape)}")

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        """N, drafts per request."""
        return self.tokens.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.logprobs.shape[2]

    @classmethod
    def from_block(cls, block: Any) -> Drafts:
        """Adapt a record with ``tokens``, ``logprobs`` and ``confidences`` (the runtime's ``DraftBlock``)."""
        conf = getattr(block, "confidences", None)
        return cls(
            tokens=block.tokens.long(),
            logprobs=block.logprobs.float(),
            confidences=None if conf is None else conf.float(),
        )


@dataclass(frozen=True)
class ProposeBatch:
    """What the engine passes a proposer for one drafting call (after a decode or verify step).

    Attributes:
        anchors: int64 [B] x_0, the last emitted token of each request.
        anchor_positions: int64 [B] a, the absolute position of x_0 (draft k is for position a+k).
        seeds: int64 [B] the requests' seq_seed (uint64 bits); the proposer adds ``DRAFT_SEED_OFFSET``.
        temperature, top_p, min_p: fp32 / fp64 [B] the requests' sampling parameters; top_k int64 [B];
            greedy bool [B] (decisions B4; the draft uses the request's own parameters, D3).
        stopped: bool [B] the request emitted EOS or a stop token this step (procedure D step 6:
            its confidences become 0).
        context: whatever the runtime's proposer needs beyond this (caches, forward context); the
            spec package never looks inside.
    """

    anchors: torch.Tensor
    anchor_positions: torch.Tensor
    seeds: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    stopped: torch.Tensor
    context: Any = field(default=None, compare=False)


@runtime_checkable
class Proposer(Protocol):
    """A draft proposer (DSpark block drafting, V4 MTP, ...).

    ``num_speculative_tokens`` is the N it drafts per request; ``propose`` returns a ``Drafts`` with
    tokens [B, N], logprobs [B, N, V] and confidences [B, N] (or None) for the batch's requests in
    order. It must be row-invariant and use only the draft random stream (decision B3).
    """

    num_speculative_tokens: int

    def propose(self, batch: ProposeBatch) -> Drafts: ...

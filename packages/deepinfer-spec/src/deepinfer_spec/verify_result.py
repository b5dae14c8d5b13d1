"""The verification record and the pieces both verifiers share: input checks, the target-row layout,
and the seeded inverse-CDF draw of the emitted token (decisions B3).

Target rows come in one of two layouts (whichever the runner has at hand):

* padded: fp32 [B, N+1, V], row j of request b at ``[b, j]`` (rows past ``num_verified[b]`` ignored);
* flat: fp32 [R, V] with R = sum(num_verified + 1), request b's rows contiguous and in request
  order (the verify forward's own row order), row j of request b at ``offset_b + j``.

Every operation is elementwise, a gather, an integer count or a per-row fp64 ``cumsum`` (sums are
the cumsum's last element), so a request's result is bitwise independent of the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import Drafts


@dataclass(frozen=True)
class VerifyResult:
    """What one verification step emitted, per request.

    Attributes:
        num_accepted: int64 [B] accepted drafts (0 .. num_verified[b]).
        tokens: int64 [B, N+1] emitted tokens: the accepted drafts, then one target token (the
            residual resample at the first rejection, or the bonus when every verified draft was
            accepted); -1 after the first ``num_accepted + 1`` entries. The last emitted token is
            the next anchor.
        logprobs: fp32 [B, N+1] the processed target log-probability log q_j(token_j) of each
            emitted token (what DeepInfer reports, decision B4.5); 0 where ``tokens`` is -1.
        resampled: bool [B] True when the last emitted token came from the residual (a rejection),
            False when it is the bonus token.
        num_verified: int64 [B] the drafts each request verified (the input, for statistics).
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    logprobs: torch.Tensor
    resampled: torch.Tensor
    num_verified: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """int64 [B] tokens emitted this step: accepted drafts + 1."""
        return self.num_accepted + 1


def check_inputs(
    fn: str,
    target_logprobs: torch.Tensor,
    drafts: Drafts,
    num_verified: torch.Tensor,
    seeds: torch.Tensor,
    anchor_positions: torch.Tensor,
) -> torch.Tensor:
    """Validate the shared arguments; return the flat [R, V] target rows."""
    b, n, v = drafts.batch_size, drafts.num_tokens, drafts.vocab_size
    if n < 1:
        raise ValueError(f"{fn}: drafts must hold N >= 1 tokens per request, got {n}")
    for name, t in (("num_verified", num_verified), ("seeds", seeds), ("anchor_positions", anchor_positions)):
        if t.shape != (b,) or t.dtype != torch.int64:
            raise ValueError(f"{fn}: {name} must be int64 [B] = [{b}], got {t.dtype}{tuple(t.shape)}")
    if bool(((num_verified < 0) | (num_verified > n)).any()):
        raise ValueError(f"{fn}: num_verified must lie in [0, N = {n}], got {num_verified.tolist()}")
    if target_logprobs.dtype != torch.float32:
        raise ValueError(f"{fn}: target_logprobs must be fp32, got {target_logprobs.dtype}")
    if target_logprobs.dim() == 3:
        if target_logprobs.shape != (b, n + 1, v):
            raise ValueError(
                f"{fn}: padded target_logprobs must be [B, N+1, V] = {(b, n + 1, v)}, "
                f"got {tuple(target_logprobs.shape)}"
            )
        return target_logprobs.reshape(b * (n + 1), v)
    rows = int((num_verified + 1).sum())
    if target_logprobs.dim() != 2 or target_logprobs.shape != (rows, v):
        raise ValueError(
            f"{fn}: flat target_logprobs must be [sum(num_verified + 1), V] = {(rows, v)}, "
            f"got {tuple(target_logprobs.shape)}"
        )
    return target_logprobs


def target_row_index(target_logprobs: torch.Tensor, num_verified: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [B, N+1]: the flat row of (request b, verify row j), j clamped to num_verified[b]."""
    b = num_verified.shape[0]
    j = torch.arange(n + 1, device=num_verified.device).unsqueeze(0)
    j = torch.minimum(j, num_verified.unsqueeze(1))
    if target_logprobs.dim() == 3:
        start = torch.arange(b, device=num_verified.device) * (n + 1)
    else:
        start = torch.cumsum(num_verified + 1, 0) - (num_verified + 1)
    return start.unsqueeze(1) + j


def draw_emitted(
    lq: torch.Tensor, lp: torch.Tensor, q_scale: torch.Tensor, p_scale: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The emitted (residual or bonus) token of each row, by the draw of decisions B3.

    weights = max(q_scale * exp(lq) - p_scale * exp(lp), 0): a residual where p_scale > 0, the
    target distribution itself where p_scale = 0 (bonus rows). The token is the first index whose
    fp64 cumulative sum of the weights exceeds u times their total, never past the last positive
    weight. A row whose weights are all 0 (inputs that are not distributions) falls back to exp(lq),
    the lossless choice.

    Args:
        lq, lp: fp32 [B, V] target and draft log-distributions of the emitting row.
        q_scale, p_scale: fp32 [B] per-row factors.
        u: fp64 [B] uniforms in [0, 1).

    Returns:
        int64 [B].
    """
    w = torch.clamp(q_scale.unsqueeze(1) * torch.exp(lq) - p_scale.unsqueeze(1) * torch.exp(lp), min=0.0)
    cum = w.double().cumsum(-1)
    empty = cum[:, -1] <= 0
    if bool(empty.any()):
        cum[empty] = torch.exp(lq[empty]).double().cumsum(-1)
    total = cum[:, -1:]
    first_above = (cum <= u.unsqueeze(1) * total).sum(-1)
    last_positive = (cum < total).sum(-1)  # cum reaches its total at the last positive weight
    return torch.minimum(first_above, last_positive)


def row_total(weights: torch.Tensor) -> torch.Tensor:
    """fp64 [B] row sums taken as the last element of an fp64 cumsum (row-invariant; see kernels'
    sampling reference on why not ``torch.sum``)."""
    return weights.double().cumsum(-1)[..., -1]


def assemble(
    draft_tokens: torch.Tensor,
    draft_target_logprobs: torch.Tensor,
    num_accepted: torch.Tensor,
    last_token: torch.Tensor,
    last_logprob: torch.Tensor,
    resampled: torch.Tensor,
    num_verified: torch.Tensor,
) -> VerifyResult:
    """Build the ``VerifyResult``: accepted drafts, then the target token at index ``num_accepted``."""
    b, n = draft_tokens.shape
    j = torch.arange(n + 1, device=draft_tokens.device).unsqueeze(0)
    acc = num_accepted.unsqueeze(1)
    pad_tok = torch.full((b, 1), -1, dtype=torch.int64, device=draft_tokens.device)
    pad_lp = torch.zeros((b, 1), dtype=torch.float32, device=draft_tokens.device)
    tokens = torch.where(j < acc, torch.cat([draft_tokens, pad_tok], 1), pad_tok)
    logprobs = torch.where(j < acc, torch.cat([draft_target_logprobs, pad_lp], 1), pad_lp)
    tokens = torch.where(j == acc, last_token.unsqueeze(1), tokens)
    logprobs = torch.where(j == acc, last_logprob.unsqueeze(1), logprobs)
    return VerifyResult(num_accepted, tokens, logprobs, resampled, num_verified)

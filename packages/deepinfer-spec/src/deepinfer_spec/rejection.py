"""Procedure V (decisions section 3): DeepInfer's token-level speculative rejection sampling.

For request b with anchor x_0 at position a and m = num_verified[b] drafts d_1 .. d_m, the target ran
rows j = 0 .. m at positions a .. a+m; row j's processed distribution q_j predicts position a+j+1 and
verifies d_{j+1} (row m is the fresh row). p_j is the stored processed draft distribution of d_{j+1}.

V.3 Accept d_{j+1} iff exp(min(log q_j(d) - log p_j(d), 0)) > u_acc, u_acc = ``accept_uniforms(seed,
   a+j+1)``; acceptance stops at the first rejection. A draft id of -1 always rejects (and its p is
   taken as 0, so its residual is q_j).
V.4 At the first rejection (row j) the emitted token is drawn from the unnormalised residual
   r = max(q_j - e^(-5e-5) p_j, 0) with the resample uniform (c = 1) at position a+j+1. If all m
   drafts are accepted, the bonus token is drawn from q_m with the fresh uniform (c = 0) at a+m+1.

Greedy requests need nothing special (decision D4): their q and p are the T = 1e-5 distributions
(``processed_logprobs(..., greedy=True)``), so a draft equal to the target's argmax has ratio 1 and
is accepted, any other draft has q(d) ~ 0 and is rejected, and the residual is the argmax: the
emitted tokens are the target's argmax chain.

The output distribution equals the target's up to the e^(-5e-5) factor (DI's ``DRAFT_PROB_PENALTY``,
which keeps the residual non-empty when q = p): a total-variation error below 5e-5 per token.
"""

from __future__ import annotations

import math

import torch
from deepinfer_kernels.ops.sampling import accept_uniforms, sampling_uniforms

from .protocol import Drafts
from .verify_result import VerifyResult, assemble, check_inputs, draw_emitted, target_row_index

DRAFT_PROB_PENALTY = math.exp(-5e-5)  # procedure V.4: residual = max(q - e^(-5e-5) p, 0)


def rejection_verify(
    target_logprobs: torch.Tensor,
    drafts: Drafts,
    num_verified: torch.Tensor,
    seeds: torch.Tensor,
    anchor_positions: torch.Tensor,
) -> VerifyResult:
    """Verify each request's first ``num_verified[b]`` drafts by procedure V.

    Args:
        target_logprobs: fp32 processed target log-distributions of the verify rows, padded
            [B, N+1, V] or flat [sum(num_verified + 1), V] (see ``verify_result``); -inf = filtered.
        drafts: the proposer's ``Drafts`` (tokens int64 [B, N], logprobs fp32 [B, N, V]).
        num_verified: int64 [B] m_b in [0, N], the drafts verified (procedure S, or N with varlen off).
        seeds: int64 [B] the requests' seq_seed (uint64 bits, target stream: no offset).
        anchor_positions: int64 [B] a, the position of each request's anchor x_0.

    Returns:
        ``VerifyResult``. Row-invariant and reproducible: a request's result depends only on its
        own rows, seed and positions.
    """
    flat = check_inputs("rejection_verify", target_logprobs, drafts, num_verified, seeds, anchor_positions)
    b, n = drafts.batch_size, drafts.num_tokens
    dev = drafts.tokens.device
    rows = target_row_index(target_logprobs, num_verified, n)  # [B, N+1]
    j = torch.arange(n, device=dev).unsqueeze(0)
    tokens = drafts.tokens
    d = tokens.clamp(min=0)

    # V.3: the accept test on every verified draft; acceptance stops at the first rejection.
    lq_d = flat[rows[:, :n], d]  # [B, N] log q_j(d_{j+1})
    lp_d = drafts.logprobs.gather(2, d.unsqueeze(2)).squeeze(2)  # [B, N] log p_j(d_{j+1})
    ratio = torch.exp(torch.clamp(lq_d - lp_d, max=0.0))  # NaN (both -inf) compares False: reject
    pos = anchor_positions.unsqueeze(1) + j + 1
    u_acc = accept_uniforms(seeds.unsqueeze(1).expand(b, n), pos)
    ok = (j < num_verified.unsqueeze(1)) & (tokens >= 0) & (ratio.double() > u_acc)
    num_accepted = torch.cumprod(ok.to(torch.int64), 1).sum(1)

    # V.4: the emitted token, from row e = num_accepted.
    e = num_accepted
    rejected = e < num_verified
    rows_b = torch.arange(b, device=dev)
    lq_e = flat[rows[rows_b, e]]  # [B, V] q_e
    e_draft = e.clamp(max=n - 1)
    lp_e = drafts.logprobs[rows_b, e_draft]  # [B, V] p_e (used only where rejected)
    # Residual max(q - e^(-5e-5) p, 0) at a rejection (p = 0 for a missing draft), q at the bonus row.
    # NOTE: with the penalty a valid row's residual is never empty.
    p_scale = torch.where(rejected & (tokens[rows_b, e_draft] >= 0), DRAFT_PROB_PENALTY, 0.0).float()
    e_pos = anchor_positions + e + 1
    u = torch.where(rejected, sampling_uniforms(seeds, e_pos, resample=True), sampling_uniforms(seeds, e_pos))
    last = draw_emitted(lq_e, lp_e, torch.ones_like(p_scale), p_scale, u)
    last_lp = lq_e.gather(1, last.unsqueeze(1)).squeeze(1)
    return assemble(tokens, lq_d, num_accepted, last, last_lp, rejected, num_verified)

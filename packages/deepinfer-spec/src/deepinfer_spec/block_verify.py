"""Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
arXiv 2403.10444), vLLM's ``rejection_sample_method: "block"``: an opt-in alternative to procedure V
(decision D4). Lossless, and accepts at least as many drafts in expectation as token-level
verification.

Notation as in ``rejection.py``: row j's target distribution q_j verifies d_{j+1}, whose draft
distribution is p_j; m = num_verified[b] (a -1 draft ends the block early).

1. Joint prefix ratio: w_0 = 1, w_i = min(1, w_{i-1} q_{i-1}(d_i) / p_{i-1}(d_i)) (log domain).
2. Continuation probability: for i < m, R_i = sum_x max(w_i q_i(x) - p_i(x), 0) and
   h_i = R_i / (R_i + 1 - w_i) (1 when that denominator is <= 0); h_m = w_m.
3. With independent uniforms u_i = ``accept_uniforms(block_step_seeds(seed, a), a+i)``, tau = the largest i in 1..m with
   u_i < h_i (0 if none): d_1 .. d_tau are accepted (each test is made; a later pass can accept a
   prefix that an earlier test "rejected").
4. If tau < m the next token is drawn from max(w_tau q_tau - p_tau, 0) with the resample uniform
   (c = 1) at position a+tau+1; if tau = m the bonus is drawn from q_m with the fresh uniform (c = 0).

Random streams. Unlike procedure V, every accept uniform u_1 .. u_m and every draft d_1 .. d_m
influences tau, so a position's uniforms are *observed* even when its draft is discarded; the next
step re-drafts and re-tests those positions, and with the plain (seed, position) streams of decision
B3 it would reuse uniforms whose values the history already constrains (no longer exact). Block
verification therefore keys its accept uniforms by a per-step seed, ``block_step_seeds(seed, a)``
(vLLM mixes the draft index into the seed for the same reason), and the engine must give the
proposer the same per-step seeds in block mode (``ProposeBatch.seeds = block_step_seeds(...)``) so the
draft stream is fresh too. Residual and bonus uniforms stay on the target stream: a position's
emitted token is drawn once.

Greedy rows behave as in procedure V (T = 1e-5 distributions): accepted drafts are exactly the
prefix that matches the target's argmax chain.
"""

from __future__ import annotations

import torch
from deepinfer_kernels.ops.sampling import accept_uniforms, sampling_uniforms

from .protocol import Drafts
from .verify_result import VerifyResult, assemble, check_inputs, draw_emitted, row_total, target_row_index

BLOCK_STEP_MULTIPLIER = -0x2E4AB5CD2E6D12FD  # 0xD1B54A32D192ED03 as int64 bits (odd)


def block_step_seeds(seeds: torch.Tensor, anchor_positions: torch.Tensor) -> torch.Tensor:
    """int64 [B] seed + 0xD1B54A32D192ED03 * (a + 1) modulo 2^64: a seed of its own for each block
    (the anchor position a grows every step), for block verification's accept uniforms and drafts."""
    return seeds + BLOCK_STEP_MULTIPLIER * (anchor_positions + 1)


def block_verify(
    target_logprobs: torch.Tensor,
    drafts: Drafts,
    num_verified: torch.Tensor,
    seeds: torch.Tensor,
    anchor_positions: torch.Tensor,
) -> VerifyResult:
    """Verify each request's first ``num_verified[b]`` drafts as one block (Sun et al., Algorithm 2).

    Arguments and result exactly as ``rejection_verify`` (same layouts; ``seeds`` are the requests'
    seq_seed; the accept uniforms use ``block_step_seeds``, see the module docstring).
    Costs one extra pass over the vocabulary per verified draft (the residual masses R_i).
    """
    flat = check_inputs("block_verify", target_logprobs, drafts, num_verified, seeds, anchor_positions)
    b, n = drafts.batch_size, drafts.num_tokens
    dev = drafts.tokens.device
    rows = target_row_index(target_logprobs, num_verified, n)  # [B, N+1]
    j = torch.arange(n, device=dev).unsqueeze(0)
    tokens = drafts.tokens
    d = tokens.clamp(min=0)

    # The block ends at the first missing (-1) draft.
    present = (j < num_verified.unsqueeze(1)) & (tokens >= 0)
    m = torch.cumprod(present.to(torch.int64), 1).sum(1)

    # Step 1: log w_i, i = 1..N (column i-1).
    lq_d = flat[rows[:, :n], d]
    lp_d = drafts.logprobs.gather(2, d.unsqueeze(2)).squeeze(2)
    step = torch.nan_to_num(lq_d - lp_d, nan=float("-inf"), posinf=0.0)  # -inf - -inf: impossible draft
    log_w = []
    acc_log = torch.zeros(b, dtype=torch.float32, device=dev)
    for i in range(n):
        acc_log = torch.clamp(acc_log + step[:, i], max=0.0)
        log_w.append(acc_log)
    w = torch.exp(torch.stack(log_w, 1))  # [B, N], w[:, i-1] = w_i

    # Step 2: h_i. R_i needs row i (q_i) and draft distribution i (p_i), i = 1..N-1.
    h = w.clone()
    if n > 1:
        q_next = torch.exp(flat[rows[:, 1:n]])  # [B, N-1, V]
        p_next = torch.exp(drafts.logprobs[:, 1:n])
        r = row_total(torch.clamp(w[:, : n - 1].unsqueeze(2) * q_next - p_next, min=0.0))  # fp64 [B, N-1]
        denom = r + 1.0 - w[:, : n - 1].double()
        h_inner = torch.where(denom > 0, r / torch.where(denom > 0, denom, torch.ones_like(denom)), 1.0)
        is_last = (j[:, : n - 1] + 1) == m.unsqueeze(1)  # i = m uses h_m = w_m
        h[:, : n - 1] = torch.where(is_last, w[:, : n - 1].double(), h_inner).float()

    # Step 3: tau = the largest accepted i.
    pos = anchor_positions.unsqueeze(1) + j + 1
    step_seeds = block_step_seeds(seeds, anchor_positions)
    u = accept_uniforms(step_seeds.unsqueeze(1).expand(b, n), pos)
    ok = (j < m.unsqueeze(1)) & (u < h.double())
    tau = torch.where(ok, j + 1, torch.zeros_like(j)).amax(1)

    # Step 4: the residual at row tau, or the bonus from q_m.
    rows_b = torch.arange(b, device=dev)
    rejected = tau < m
    lq_e = flat[rows[rows_b, tau]]
    lp_e = drafts.logprobs[rows_b, tau.clamp(max=n - 1)]
    w_tau = torch.where(tau > 0, w[rows_b, (tau - 1).clamp(min=0)], torch.ones_like(w[:, 0]))
    # Residual max(w_tau q_tau - p_tau, 0) at a rejection, q_m for the bonus. NOTE: a rejection at
    # tau >= 1 implies R_tau > 0; at tau = 0 an empty residual means q_0 = p_0 (then q_0 is drawn).
    q_scale = torch.where(rejected, w_tau, 1.0).float()
    p_scale = rejected.float()
    e_pos = anchor_positions + tau + 1
    u_e = torch.where(rejected, sampling_uniforms(seeds, e_pos, resample=True), sampling_uniforms(seeds, e_pos))
    last = draw_emitted(lq_e, lp_e, q_scale, p_scale, u_e)
    last_lp = lq_e.gather(1, last.unsqueeze(1)).squeeze(1)
    return assemble(tokens, lq_d, tau, last, last_lp, rejected, num_verified)

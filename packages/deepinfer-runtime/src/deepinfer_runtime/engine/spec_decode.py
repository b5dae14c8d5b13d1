"""Speculative decoding in the engine: verify a step's [anchor, drafts] chunks, draft the next ones.

One step, for a decoding request with drafts d_1..d_k (the engine runs synchronously: step N+1's drafts need
step N's emitted tokens):

1. the scheduler runs [anchor, d_1..d_k] as one chunk (drafts are tokens under its one rule);
2. the runner takes logits of those k + 1 rows; ``SpecDecoder.verify`` processes them with the request's own
   sampler (row j sees the drafts before it as output history: penalties, min_tokens) and runs procedure V
   (``deepinfer_spec.rejection_verify``) or vLLM's block verification;
3. the engine appends the accepted drafts plus the residual / bonus token and rolls every cache back by the
   k - accepted rejected tokens (``model.rollback_cache``; the rings hold B = N + 1 extra rows, decision Y6);
4. ``SpecDecoder.propose`` drafts the next block for every request that emitted tokens (D6 placeholders right
   after a prefill for DSpark, as DeepInfer does).

With ``varlen`` (procedure S) each request verifies only a prefix of its drafts chosen from the survivals
(cumulative confidences) under a per-step row budget; that makes lengths batch-dependent (decision B2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer_kernels.ops.sampling import log_softmax_rows, seed_to_int64
from deepinfer_spec import (
    Drafts,
    ProposeBatch,
    SpecStats,
    SpeculativeConfig,
    admit,
    block_step_seeds,
    choose_budget,
    placeholder_drafts,
    survivals,
    verify,
)
from deepinfer_spec.varlen import VerifyCostModel

from deepinfer_runtime.host_copy import host_tensor
from deepinfer_runtime.sampler import Logprob, Sampler, SamplerOutput, SamplingRequest, _fill_logprobs


@dataclass
class SpecOutcome:
    """One request's verification: emitted ``tokens`` (accepted drafts, then the residual or bonus token),
    their processed target logprobs, logprob entries when asked, and the counts for statistics."""

    tokens: list[int]
    logprobs: list[float]
    entries: list[dict[int, Logprob]] | None
    num_accepted: int
    num_verified: int
    placeholder: bool

    @property
    def num_rejected(self) -> int:
        return self.num_verified - self.num_accepted


class SpecDecoder:
    """Verification and drafting for one engine (see the module docstring).

    Args:
        config: the validated ``SpeculativeConfig``.
        proposer: a ``deepinfer_spec.Proposer`` (``engine.proposers``).
        vocab_size: V of the target model (D6 placeholders).
        max_model_len: the engine's length cap (drafts never run past it).
        max_rows: the step's token budget (varlen's row cap).
        device: where drafts and their distributions live (the model's device).
    """

    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int, max_model_len: int, max_rows: int, device):
        self.config, self.proposer, self.vocab_size = config, proposer, vocab_size
        self.max_model_len, self.max_rows, self.device = max_model_len, max_rows, torch.device(device)
        self.stats = SpecStats()
        self._prev_survivals = torch.zeros(0, config.num_speculative_tokens)

    @property
    def backtrack(self) -> int:
        """B = N + 1 (decisions Y6): the most tokens a verify step rolls back, plus one."""
        return self.config.num_speculative_tokens + 1

    def summary(self) -> str:
        t = self.stats.total
        rates = ", ".join(f"{r:.2f}" for r in t.position_acceptance_rates)
        return (
            f"speculative decoding ({self.config.method}, N={self.config.num_speculative_tokens}, "
            f"{self.config.verification}): {t.steps} verify steps, mean accepted length {t.mean_accepted_length:.2f}, "
            f"acceptance {t.accepted}/{t.verified} = {t.acceptance_rate:.2%}, per position [{rates}]"
        )

    # --- verification (runner side) ----------------------------------------------------------------------
    def verify(self, sampler: Sampler, items: list[tuple]) -> dict[str, SpecOutcome]:
        """``items``: (request, anchor position a, logits fp32 [k + 1, V] of rows a .. a+k) per verifying
        request; returns each request's ``SpecOutcome``."""
        rows, drafts_k = [], []
        for req, a, _ in items:
            k = len(req.spec_token_ids)
            drafts_k.append(k)
            for j in range(k + 1):  # row j predicts position a+j+1 after output + d_1..d_j
                history = req.output_token_ids + req.spec_token_ids[:j]
                rows.append(SamplingRequest(req.params, req.prompt_token_ids, history, req.seed, a + j + 1))
        logits = torch.cat([lg for _, _, lg in items]).float()
        target = log_softmax_rows(sampler.process(logits, rows))
        dev, n, b = logits.device, max(drafts_k), len(items)
        tokens = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        draft_lp = torch.zeros(b, n, logits.shape[1], device=dev)
        for i, ((req, _, _), k) in enumerate(zip(items, drafts_k)):
            tokens[i, :k] = host_tensor(req.spec_token_ids, torch.int64, dev)
            draft_lp[i, :k] = req.spec_logprobs.to(dev)
        num_verified = host_tensor(drafts_k, torch.int64, dev)
        seeds = host_tensor([seed_to_int64(req.seed) for req, _, _ in items], torch.int64, dev)
        anchors = host_tensor([a for _, a, _ in items], torch.int64, dev)
        res = verify(self.config.verification, target, Drafts(tokens, draft_lp), num_verified, seeds, anchors)
        emitted, lps, acc = res.tokens.tolist(), res.logprobs.tolist(), res.num_accepted.tolist()
        out, offset = {}, 0
        for i, ((req, _, _), k) in enumerate(zip(items, drafts_k)):
            m = acc[i] + 1
            toks = emitted[i][:m]
            entries = None
            if req.params.logprobs is not None:
                so = SamplerOutput(token_ids=host_tensor(toks, torch.int64, dev))
                _fill_logprobs(so, target[offset : offset + m], [req.params.logprobs] * m)
                entries = [so.logprobs_for(j) for j in range(m)]
            out[req.request_id] = SpecOutcome(toks, lps[i][:m], entries, acc[i], k, req.spec_placeholder)
            offset += k + 1
        return out

    def record(self, req, outcome: SpecOutcome) -> None:
        """Count one verify step (D6 placeholder steps measure nothing about the proposer: skipped)."""
        proposed = max(req.spec_num_proposed, outcome.num_verified)
        self.stats.record(req.request_id, proposed, outcome.num_verified, outcome.num_accepted, outcome.placeholder)

    # --- drafting (engine side, after a step's tokens are known) -----------------------------------------
    def _draft_room(self, req) -> int:
        """Drafts this request may verify next step: every accepted draft plus the bonus must fit max_tokens
        and max_model_len; structured-output requests do not speculate."""
        if req.grammar is not None:
            return 0
        room = min(self.config.num_speculative_tokens, self.max_model_len - req.num_known_tokens - 1)
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(room, 0)

    def propose(self, reqs: list, after_prefill: list[bool]) -> None:
        """Set ``spec_token_ids`` / ``spec_logprobs`` of each request for its next step."""
        todo, rooms = [], []
        for req, first in zip(reqs, after_prefill):
            req.clear_drafts()
            room = self._draft_room(req)
            if room <= 0:
                continue
            if first and self.proposer.placeholders_after_prefill:
                d = placeholder_drafts(1, room, self.vocab_size, self.device)
                req.spec_token_ids, req.spec_logprobs, req.spec_placeholder = d.tokens[0].tolist(), d.logprobs[0], True
                continue
            todo.append(req)
            rooms.append(room)
        if not todo:
            return
        drafts = self.proposer.propose(self._batch(todo))
        keep = self._verify_lengths(drafts, rooms)
        tokens = drafts.tokens.tolist()
        for i, req in enumerate(todo):
            valid = next((j for j, t in enumerate(tokens[i]) if t < 0), len(tokens[i]))  # -1 pads fewer drafts
            k = min(keep[i], valid)
            req.spec_num_proposed = min(valid, rooms[i])
            if k:
                req.spec_token_ids, req.spec_logprobs = tokens[i][:k], drafts.logprobs[i, :k]

    def _verify_lengths(self, drafts: Drafts, rooms: list[int]) -> list[int]:
        """Drafts each request verifies: all it has room for, or procedure S's prefix under varlen."""
        if not self.config.varlen:
            return rooms
        dev = drafts.tokens.device
        n = drafts.num_tokens
        has = host_tensor(rooms, torch.int64, dev).clamp(max=n)
        valid = (drafts.tokens >= 0).to(torch.int64).cumprod(1).sum(1)
        has = torch.minimum(has, valid)
        current = survivals(drafts.confidences, has)
        cap = min(self.max_rows, self.config.verify_budget or self.max_rows)
        # no profiled graphs on this engine: a flat cost, so B* grows while survivals add expected tokens
        cost = VerifyCostModel(tuple(range(1, cap + 1)), tuple(1.0 for _ in range(cap)))
        budget = choose_budget(self._prev_survivals.to(dev), cost, len(rooms), cap)
        num = admit(current, max(budget, len(rooms)))
        self._prev_survivals = current.cpu()  # the block about to be verified sizes the next step's budget
        return num.tolist()

    def _batch(self, reqs: list) -> ProposeBatch:
        dev = self.device
        params = [r.params for r in reqs]
        anchors = host_tensor([r.output_token_ids[-1] for r in reqs], torch.int64, dev)
        positions = host_tensor([r.num_known_tokens - 1 for r in reqs], torch.int64, dev)
        seeds = host_tensor([seed_to_int64(r.seed) for r in reqs], torch.int64, dev)
        if self.config.verification == "block":  # fresh draft streams per block (see block_verify)
            seeds = block_step_seeds(seeds, positions)
        kind = self.proposer.context_kind
        if kind == "caches":
            context = [r.cache for r in reqs]
        elif kind == "tokens":
            context = [r.token_ids(0, r.num_known_tokens) for r in reqs]
        else:  # "caches+tokens"
            context = [(r.cache, r.token_ids) for r in reqs]
        return ProposeBatch(
            anchors=anchors,
            anchor_positions=positions,
            seeds=seeds,
            temperature=host_tensor([p.temperature for p in params], torch.float32, dev),
            top_k=host_tensor([max(p.top_k, 0) for p in params], torch.int64, dev),
            top_p=host_tensor([p.top_p for p in params], torch.float64, dev),
            min_p=host_tensor([p.min_p for p in params], torch.float32, dev),
            greedy=host_tensor([p.greedy for p in params], torch.bool, dev),
            stopped=torch.zeros(len(reqs), dtype=torch.bool, device=dev),
            context=context,
        )

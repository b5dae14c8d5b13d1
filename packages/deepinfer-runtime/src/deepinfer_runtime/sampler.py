"""The batched sampler: one token per request from a [B, V] block of logits.

Order (vLLM's, with DeepInfer's filter semantics; docs/model_v41_decisions.md section 4):

1. logits in fp32; ``logit_bias`` added;
2. ``min_tokens``: while fewer than min_tokens tokens are out, EOS (unless ignore_eos) and
   ``stop_token_ids`` are set to -inf;
3. penalties (repetition on prompt + output tokens, then frequency and presence on output tokens);
4. temperature (greedy = T floored to 1e-5, filters off), min-p, top-p, then top-k (B4);
5. one seeded draw per row from (seed, position) only (B3): bitwise the same token whatever else
   is in the batch and across runs;
6. logprobs, when any request asks: the processed log-distribution (B4.5), the sampled token's
   logprob and rank always, plus the top-``logprobs`` alternatives.

The per-request Python work is gathering small parameters and token-id lists; everything over
the vocabulary is batched tensor work in the row-invariant ops of ``deepinfer_kernels``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from deepinfer_kernels.ops.sampling import (
    apply_penalties,
    draw_tokens,
    log_softmax_rows,
    process_logits,
    seed_to_int64,
    topk_logprobs,
)

from deepinfer_runtime.host_copy import host_tensor, long_tensor
from deepinfer_runtime.sampling_params import SamplingParams

_U64 = 1 << 64
_PHI = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _PHI) % _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _U64
    return x ^ (x >> 31)


def derive_request_seed(llm_seed: int, request_index: int) -> int:
    """The seed of a request that gives none: SplitMix64 of (llm_seed + index * phi) mod 2^64.

    Deterministic in (LLM seed, request index), so unseeded requests are reproducible run to run.
    """
    return _splitmix64((llm_seed + request_index * _PHI) % _U64)


def child_seed(seed: int, index: int) -> int:
    """Seed of output sequence ``index`` of an n > 1 request: (seed + index) mod 2^64 (as vLLM)."""
    return (seed + index) % _U64


@dataclass
class SamplingRequest:
    """One row of a sampler call.

    Attributes:
        params: the request's SamplingParams.
        prompt_token_ids: the prompt (repetition penalty).
        output_token_ids: tokens generated so far (penalties, min_tokens).
        seed: the effective uint64 seed; None takes ``params.seed`` (then one of them must be set:
            the engine supplies ``derive_request_seed`` for unseeded requests).
        position: absolute position of the token being produced (decisions B3 ``pos``); None means
            len(prompt_token_ids) + len(output_token_ids), i.e. the prompt length for the first
            output token. Pass it explicitly for speculative rows.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    seed: int | None = None
    position: int | None = None

    def effective_seed(self) -> int:
        seed = self.seed if self.seed is not None else self.params.seed
        if seed is None:
            raise ValueError("SamplingRequest: no seed (set params.seed or pass the engine-derived seed)")
        return seed

    def effective_position(self) -> int:
        if self.position is not None:
            return self.position
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class Logprob:
    """One entry of a request's logprobs (vLLM's shape): processed logprob and 1-based rank."""

    logprob: float
    rank: int


@dataclass
class SamplerOutput:
    """Tokens, and logprobs when a request asked for them.

    Attributes:
        token_ids: int64 [B].
        sampled_logprobs: fp32 [B] logprob of each sampled token (None when nobody asked).
        sampled_ranks: int64 [B] 1 + number of tokens with a strictly larger logprob (or None).
        top_token_ids, top_logprobs: [B, K] alternatives, K = the largest ``logprobs`` asked; row b
            is meaningful up to its own ``num_logprobs[b]`` (or None).
        num_logprobs: per row, the request's ``logprobs`` (None = not asked).
    """

    token_ids: torch.Tensor
    sampled_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    num_logprobs: list[int | None] | None = None

    def logprobs_for(self, row: int) -> dict[int, Logprob] | None:
        """Row ``row``'s logprobs as vLLM returns them: the sampled token first, then the top
        alternatives (n or n + 1 entries); None when the request asked for none."""
        if self.num_logprobs is None or self.num_logprobs[row] is None:
            return None
        token = int(self.token_ids[row])
        out = {token: Logprob(float(self.sampled_logprobs[row]), int(self.sampled_ranks[row]))}
        for j in range(self.num_logprobs[row]):
            alt = int(self.top_token_ids[row, j])
            if alt not in out:
                out[alt] = Logprob(float(self.top_logprobs[row, j]), j + 1)
        return out


def _fill_logprobs(out: SamplerOutput, logprobs: torch.Tensor, num_logprobs: list[int | None]) -> None:
    """Logprob and rank of each row's ``out.token_ids`` in ``logprobs`` [B, V], plus the top alternatives up to
    the largest count asked (rank = 1 + number of tokens with a strictly larger logprob)."""
    v = logprobs.shape[-1]
    chosen = logprobs.gather(-1, out.token_ids.unsqueeze(-1))
    out.sampled_logprobs = chosen.squeeze(-1)
    out.sampled_ranks = 1 + (logprobs > chosen).sum(-1)
    k = min(max(n for n in num_logprobs if n is not None), v)
    out.top_logprobs, out.top_token_ids = topk_logprobs(logprobs, k)
    out.num_logprobs = [None if n is None else min(n, v) for n in num_logprobs]


def prompt_logprob_entries(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """Prompt logprobs (vLLM's default raw mode: log-softmax of the model's logits, no sampling
    processing): for each row of ``logits`` [n, V] fp32, the logprob and rank of ``targets[i]`` and the
    top ``k`` alternatives, in the same shape as the sampled tokens' logprobs."""
    out = SamplerOutput(token_ids=host_tensor(list(targets), torch.long, logits.device))
    _fill_logprobs(out, log_softmax_rows(logits), [k] * len(targets))
    return [out.logprobs_for(i) for i in range(len(targets))]


class Sampler:
    """Samples one token per request from a [B, V] block of logits (see the module docstring).

    Args:
        eos_token_ids: the model's EOS id(s), masked during ``min_tokens`` unless ignore_eos.
    """

    def __init__(self, eos_token_ids: int | Iterable[int] | None = None):
        if eos_token_ids is None:
            self.eos_token_ids: tuple[int, ...] = ()
        elif isinstance(eos_token_ids, int):
            self.eos_token_ids = (eos_token_ids,)
        else:
            self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def __call__(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> SamplerOutput:
        processed = self.process(logits, requests)
        device = logits.device
        seeds = host_tensor([seed_to_int64(r.effective_seed()) for r in requests], torch.int64, device)
        positions = host_tensor([r.effective_position() for r in requests], torch.int64, device)
        tokens = draw_tokens(processed, seeds, positions)
        out = SamplerOutput(token_ids=tokens)

        asked = [r.params.logprobs for r in requests]
        if any(n is not None for n in asked):
            _fill_logprobs(out, log_softmax_rows(processed), asked)
        return out

    def process(self, logits: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        """Steps 1-4 of the module docstring: the processed fp32 logits [B, V] each row samples from (-inf where
        filtered). Speculative verification compares draft tokens against these distributions."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"Sampler: logits must be [B, V] with B = {len(requests)}, got {tuple(logits.shape)}")
        device = logits.device
        x = logits.float().clone()
        params = [r.params for r in requests]

        self._add_logit_bias(x, params)
        self._mask_min_tokens(x, requests)
        x = self._apply_penalties(x, requests)

        temperature = host_tensor([p.temperature for p in params], torch.float32, device)
        top_k = host_tensor([max(p.top_k, 0) for p in params], torch.int64, device)
        top_p = host_tensor([p.top_p for p in params], torch.float64, device)
        min_p = host_tensor([p.min_p for p in params], torch.float32, device)
        greedy = host_tensor([p.greedy for p in params], torch.bool, device)
        return process_logits(x, temperature, top_k, top_p, min_p, greedy)

    @staticmethod
    def _check_ids(what: str, ids: list[int], v: int) -> None:
        bad = [t for t in ids if not 0 <= t < v]
        if bad:
            raise ValueError(f"Sampler: {what} token id(s) {bad[:5]} outside the vocabulary [0, {v})")

    def _add_logit_bias(self, x: torch.Tensor, params: list[SamplingParams]) -> None:
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                cols += list(p.logit_bias)
                vals += list(p.logit_bias.values())
        if rows:
            self._check_ids("logit_bias", cols, x.shape[1])
            idx = (long_tensor(rows, x.device), long_tensor(cols, x.device))
            x.index_put_(idx, host_tensor(vals, torch.float32, x.device), accumulate=True)

    def _mask_min_tokens(self, x: torch.Tensor, requests: Sequence[SamplingRequest]) -> None:
        rows, cols = [], []
        for i, r in enumerate(requests):
            p = r.params
            if len(r.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                rows += [i] * len(banned)
                cols += sorted(banned)
        if rows:
            self._check_ids("stop / EOS", cols, x.shape[1])
            x[long_tensor(rows, x.device), long_tensor(cols, x.device)] = float("-inf")

    def _apply_penalties(self, x: torch.Tensor, requests: Sequence[SamplingRequest]) -> torch.Tensor:
        params = [r.params for r in requests]
        if all(p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 for p in params):
            return x
        b, v = x.shape
        out_flat, prompt_flat = [], []
        for i, r in enumerate(requests):
            self._check_ids("output", list(r.output_token_ids), v)
            out_flat += [i * v + t for t in r.output_token_ids]
            if r.params.repetition_penalty != 1:
                self._check_ids("prompt", list(r.prompt_token_ids), v)
                prompt_flat += [i * v + t for t in r.prompt_token_ids]
        out_idx = host_tensor(out_flat, torch.int64, x.device)
        counts = torch.bincount(out_idx, minlength=b * v).reshape(b, v)
        prompt_mask = torch.zeros(b * v, dtype=torch.bool, device=x.device)
        prompt_mask[host_tensor(prompt_flat, torch.int64, x.device)] = True

        def col(name: str) -> torch.Tensor:
            return host_tensor([getattr(p, name) for p in params], torch.float32, x.device)

        return apply_penalties(
            x,
            counts,
            prompt_mask.reshape(b, v),
            col("presence_penalty"),
            col("frequency_penalty"),
            col("repetition_penalty"),
        )

"""The model runner: a ``StepPlan`` in, a ``StepResult`` out.

It turns each scheduled chunk into the model's varlen step input (token ids per request, the
request's model cache, YOCO prompt length for prefill chunks, and the rows that need logits),
runs the model once for the whole step, and samples one token for every chunk that reached the
end of its request's known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_runtime.engine.scheduler import StepPlan
from deepinfer_runtime.sampler import Logprob, Sampler, SamplingRequest


@dataclass
class StepResult:
    """Per sampled request: the new token, its logprob entries (or None) and the sampled logprob."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob] | None] = field(default_factory=dict)
    sampled_logprob: dict[str, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, sampler: Sampler, device: torch.device):
        self.model, self.sampler, self.device = model, sampler, device

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        chunks, caches, prompt_lens, rows = [], [], [], []
        for c in plan.chunks:
            req = c.request
            if req.cache is None:
                req.cache = self.model.new_cache()
            chunks.append(torch.tensor(req.token_ids(c.start, c.start + c.num_tokens), dtype=torch.long))
            caches.append(req.cache)
            prefill = c.start < req.prefill_len
            prompt_lens.append(req.prefill_len if prefill else None)
            last = torch.tensor([c.num_tokens - 1]) if c.sample else torch.zeros(0, dtype=torch.long)
            rows.append(last)
        logits = self.model.forward_step([ch.to(self.device) for ch in chunks], caches, prompt_lens, rows)
        sampled = [(c, lg) for c, lg in zip(plan.chunks, logits) if c.sample]
        result = StepResult()
        if not sampled:
            return result
        batch = torch.cat([lg for _, lg in sampled]).float()
        reqs = [
            SamplingRequest(c.request.params, c.request.prompt_token_ids, c.request.output_token_ids, c.request.seed)
            for c, _ in sampled
        ]
        out = self.sampler(batch, reqs)
        for row, (c, _) in enumerate(sampled):
            rid = c.request.request_id
            result.tokens[rid] = int(out.token_ids[row])
            result.logprobs[rid] = out.logprobs_for(row)
            if out.sampled_logprobs is not None:
                result.sampled_logprob[rid] = float(out.sampled_logprobs[row])
        return result

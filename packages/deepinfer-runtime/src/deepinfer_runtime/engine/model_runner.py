"""The model runner: a ``StepPlan`` in, a ``StepResult`` out (``launch`` now, ``InFlight.result`` later).

It turns each scheduled chunk into the model's varlen step input (token ids per request, the
request's model cache, YOCO prompt length for prefill chunks, and the rows that need logits),
runs the model once for the whole step, and samples one token for every chunk that reached the
end of its request's known tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_runtime.engine.scheduler import StepPlan
from deepinfer_runtime.engine.spec_decode import SpecOutcome
from deepinfer_runtime.host_copy import long_tensor
from deepinfer_runtime.kv_pool import KVPools
from deepinfer_runtime.sampler import Logprob, Sampler, SamplerOutput, SamplingRequest, prompt_logprob_entries
from deepinfer_runtime.slot_pool import SlotPool
from deepinfer_runtime.structured.mask import apply_grammar_bitmask


@dataclass
class StepResult:
    """Per sampled request: the new token, its logprob entries (or None) and the sampled logprob."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, Logprob] | None] = field(default_factory=dict)
    sampled_logprob: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)  # (first pos, ..)
    spec: dict[str, SpecOutcome] = field(default_factory=dict)  # verifying requests: their emitted tokens


class ModelRunner:
    """``pools`` hold the growing cache kinds of every request (block ids from the scheduler), ``slots`` the
    fixed-size ones (one slot per live request, made from ``model.slot_specs(B)``); a request's model cache is
    built on its first chunk: empty, or resumed from its prefix hit's snapshot. With ``spec`` (speculative
    decoding) caches keep rings of B extra rows and chunks with drafts are verified."""

    def __init__(
        self, model: torch.nn.Module, sampler: Sampler, device: torch.device, pools: KVPools, slots: SlotPool, spec=None
    ):
        self.model, self.sampler, self.device, self.pools, self.slots = model, sampler, device, pools, slots
        self.spec = spec
        self.backtrack = 0 if spec is None else spec.backtrack
        self._prev: tuple[torch.Tensor, dict[str, int]] | None = None  # last launch's sampled tokens, by request

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` and wait for its results."""
        return self.launch(plan).result()

    @torch.no_grad()
    def launch(self, plan: StepPlan) -> InFlight:
        """Enqueue ``plan`` on the device and return without waiting for it. A chunk's pending input token
        (sampled by the previous launch, value still on the device) is copied in on the device."""
        caches, prompt_lens, rows, n_prompt_rows = [], [], [], []
        chunks = self._input_ids(plan.chunks)
        for c in plan.chunks:
            req = c.request
            if req.cache is None:
                req.cache = self.new_cache(req)
            caches.append(req.cache)
            prefill = c.start < req.prefill_len
            prompt_lens.append(req.prefill_len if prefill else None)
            k = len(req.spec_token_ids) if c.sample else 0  # drafts: the anchor's and every draft's row
            # prompt logprobs: row p predicts prompt token p + 1, so rows up to the prompt's second last token
            n_plp = 0
            if req.params.prompt_logprobs is not None:
                n_plp = max(min(c.start + c.num_tokens, req.num_prompt_tokens - 1) - c.start, 0)
            n_prompt_rows.append(n_plp)
            if c.sample and k == c.num_tokens - 1 and not n_plp:  # every row (decode, verify): no row tensor
                rows.append(None)
                continue
            last = torch.arange(c.num_tokens - 1 - k, c.num_tokens) if c.sample else torch.zeros(0, dtype=torch.long)
            rows.append(torch.cat([torch.arange(n_plp), last]) if n_plp else last)
        logits = self.model.forward_step(chunks, caches, prompt_lens, rows)
        flight = InFlight()
        for c, lg, n_plp in zip(plan.chunks, logits, n_prompt_rows):
            if n_plp:
                req = c.request
                targets = req.token_ids(c.start + 1, c.start + 1 + n_plp)
                entries = prompt_logprob_entries(lg[:n_plp].float(), targets, req.params.prompt_logprobs)
                flight.prompt_logprobs[req.request_id] = (c.start + 1, entries)
        verifying = [
            (c.request, c.start + c.num_tokens - lg.shape[0], lg)
            for c, lg in zip(plan.chunks, logits)
            if c.sample and c.request.spec_token_ids
        ]
        if verifying:
            flight.spec = self.spec.verify(self.sampler, verifying)
        sampled = [(c, lg[-1:]) for c, lg in zip(plan.chunks, logits) if c.sample and not c.request.spec_token_ids]
        if not sampled:
            self._prev = None
            return flight
        batch = torch.cat([lg for _, lg in sampled]).float()
        reqs = [  # position = the sampled token's (pending tokens included), decisions B3
            SamplingRequest(
                c.request.params, c.request.prompt_token_ids, c.request.output_token_ids, c.request.seed, c.sample_at
            )
            for c, _ in sampled
        ]
        grammars = [c.request.grammar for c, _ in sampled]
        if any(g is not None for g in grammars):  # structured outputs: disallowed tokens -> -inf
            apply_grammar_bitmask(batch, grammars)
        flight.sampled = [c.request.request_id for c, _ in sampled]
        flight.out = self.sampler(batch, reqs)
        self._prev = (flight.out.token_ids, {rid: row for row, rid in enumerate(flight.sampled)})
        return flight

    def new_cache(self, req):
        """``req``'s model cache over its block table and a request slot: empty, or its prefix hit's snapshot."""
        stores = self.pools.factory(req.block_ids)
        if req.restore is not None:
            snap, req.restore = req.restore, None
            return self.model.restore_cache(snap, stores, self.backtrack)
        return self.model.new_cache(stores, self.backtrack, self.slots.claim())

    def _input_ids(self, chunks) -> list[torch.Tensor]:
        """Every chunk's token ids [n] int64 on the device, as views of one tensor: one pinned, non-blocking copy
        per step (a copy from pageable memory would wait for the device, undoing asynchronous scheduling). The
        chunks' pending last tokens (sampled by the previous launch) are filled in on the device, all in one
        gather and one scatter whose indices travel in the same copy (not two kernels per request)."""
        ids = [c.request.token_ids(c.start, c.start + c.num_tokens) for c in chunks]
        flat = [t for chunk in ids for t in chunk]
        at, rows, end = [], [], 0  # pending tokens: their places in flat, their rows of the previous launch
        for c, chunk in zip(chunks, ids):
            end += len(chunk)
            if chunk[-1] >= 0:
                continue
            req = c.request
            if -1 in chunk[:-1] or self._prev is None or req.request_id not in self._prev[1]:
                raise RuntimeError(f"request {req.request_id}: a pending token that the previous step did not sample")
            at.append(end - 1)
            rows.append(self._prev[1][req.request_id])
        n, k = len(flat), len(at)
        data = long_tensor(flat + at + rows, self.device)
        tokens = data[:n]
        if k:  # device to device: no sync
            tokens.index_copy_(0, data[n : n + k], self._prev[0].index_select(0, data[n + k :]).long())
        return list(tokens.split([len(chunk) for chunk in ids]))


@dataclass
class InFlight:
    """A launched step: its device-side sampler output, turned into a ``StepResult`` on demand."""

    prompt_logprobs: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    sampled: list[str] = field(default_factory=list)
    out: SamplerOutput | None = None

    def result(self) -> StepResult:
        """Wait for the device and convert (the only synchronisation of a step)."""
        res = StepResult(prompt_logprobs=self.prompt_logprobs, spec=self.spec)
        if self.out is None:
            return res
        out = self.out
        tokens = out.token_ids.tolist()
        for row, rid in enumerate(self.sampled):
            res.tokens[rid] = tokens[row]
            res.logprobs[rid] = out.logprobs_for(row)
            if out.sampled_logprobs is not None:
                res.sampled_logprob[rid] = float(out.sampled_logprobs[row])
        return res

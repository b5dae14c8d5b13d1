"""The engine loop: add requests, step (schedule -> run -> update), collect finished outputs."""

from __future__ import annotations

import itertools
import time

from deepinfer_runtime.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer_runtime.engine.model_runner import InFlight, ModelRunner
from deepinfer_runtime.engine.request import Request, RequestStatus
from deepinfer_runtime.engine.scheduler import Scheduler, StepPlan
from deepinfer_runtime.structured import start_grammar


class LLMEngine:
    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, tokenizer, eos_token_ids: set[int], async_scheduling=False
    ):
        self.scheduler, self.runner, self.tokenizer, self.eos = scheduler, runner, tokenizer, eos_token_ids
        self.spec = runner.spec  # speculative decoding (None: off); drafts need each step's tokens: synchronous
        if self.spec is not None and async_scheduling:
            raise ValueError("speculative decoding runs with async_scheduling off (drafts need the last step's tokens)")
        self.async_scheduling = async_scheduling
        self.num_steps = 0
        self.num_overlapped = 0  # steps processed while the next one was already launched
        self._in_flight: tuple[StepPlan, InFlight] | None = None

    def add_request(self, req: Request) -> None:
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )
        if req.params.grammar_spec is not None:  # compile in the background; waited for at the first sample
            vocab = self.runner.model.cfg.vocab_size
            req.grammar = start_grammar(req.params.grammar_spec, self.tokenizer, vocab, self.eos)
            if req.grammar.error is not None:  # e.g. llguidance missing: end it now, never schedule it
                req.status, req.finish_reason, req.error = RequestStatus.FINISHED, "error", req.grammar.error
                return
        self.scheduler.add(req)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it.

        Synchronous: schedule, run, process. Asynchronous (``async_scheduling``): schedule and launch step N,
        then process step N-1 while the device runs N, so the CPU's bookkeeping, detokenizing and the next
        schedule overlap the device. A step whose sampling needs the previous token's value (penalties,
        min_tokens, grammars) first drains the step in flight: outputs are the same either way.
        """
        finished: list[Request] = []
        if self._in_flight is not None and (not self.async_scheduling or self._needs_history()):
            finished += self._process(*self._in_flight)
            self._in_flight = None
        plan = self.scheduler.schedule()
        launched = None
        if plan.chunks:
            launched = (plan, self.runner.launch(plan))
            self.num_steps += 1
            for chunk in plan.chunks:  # the Python-side caches are at this step's end now: snapshot here
                self.scheduler.computed(chunk.request, chunk.num_tokens, chunk.request.cache.snapshot)
                if chunk.sample:
                    chunk.request.num_pending += 1
        elif self._in_flight is None and self.scheduler.has_unfinished:
            raise RuntimeError("scheduler made no progress: a request does not fit the KV cache budget")
        if self._in_flight is not None:
            self.num_overlapped += launched is not None
            finished += self._process(*self._in_flight)
        self._in_flight = launched
        if not self.async_scheduling and launched is not None:
            finished += self._process(*launched)
            self._in_flight = None
        return finished

    def _needs_history(self) -> bool:
        """Does some request with a token still in flight need that token's value to sample its next one?"""
        reqs = itertools.chain(self.scheduler.running, self.scheduler.waiting)
        return any(r.num_pending and r.sampler_needs_history for r in reqs)

    def _process(self, plan: StepPlan, flight: InFlight) -> list[Request]:
        """Apply a finished step's results: prompt logprobs, new tokens, stop checks; with speculative
        decoding, the verified tokens, the rollback of rejected drafts and the next drafts."""
        result = flight.result()
        now = time.perf_counter()
        finished, drafting, after_prefill = [], [], []
        for chunk in plan.chunks:
            req = chunk.request
            if req.request_id in result.prompt_logprobs:  # positions are absolute: a recompute overwrites
                first, entries = result.prompt_logprobs[req.request_id]
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = [None] * req.num_prompt_tokens
                req.prompt_logprobs[first : first + len(entries)] = entries
            outcome = result.spec.get(req.request_id)
            if outcome is not None:
                req.num_pending -= 1
                self._apply_verified(req, outcome, now, finished)
            else:
                token = result.tokens.get(req.request_id)
                if token is None:
                    continue
                req.num_pending -= 1
                if req.finished:  # it stopped on the previous step's token; this one ran past the end
                    continue
                logprob = result.sampled_logprob.get(req.request_id)
                self._append(req, token, result.logprobs.get(req.request_id), logprob, now, finished)
            if self.spec is not None and not req.finished:
                drafting.append(req)
                after_prefill.append(chunk.start < req.prefill_len)
        if drafting:
            self.spec.propose(drafting, after_prefill)
        return finished

    def _apply_verified(self, req: Request, outcome, now: float, finished: list[Request]) -> None:
        """Append a verify step's emitted tokens (up to a stop), count it, and roll the rejected drafts back."""
        req.clear_drafts()
        self.spec.record(req, outcome)
        for i, token in enumerate(outcome.tokens):
            entry = None if outcome.entries is None else outcome.entries[i]
            if self._append(req, token, entry, outcome.logprobs[i], now, finished):
                return  # tokens after a stop are dropped with the request's caches
        if outcome.num_rejected:
            req.num_computed_tokens -= outcome.num_rejected
            self.runner.model.rollback_cache(req.cache, outcome.num_rejected, req.token_ids)

    def _append(self, req: Request, token: int, logprobs, sampled_logprob, now: float, finished: list) -> bool:
        """Append one sampled token and apply the stop rules; True when the request finished."""
        if req.grammar is not None and not req.grammar.accept(token):  # bad grammar: this request only
            req.error = req.grammar.error
            self.scheduler.finish(req, "error")
            req.finish_time = now
            finished.append(req)
            return True
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None:
            req.logprobs.append(logprobs)
        if sampled_logprob is not None:
            req.cumulative_logprob += sampled_logprob
        reason = self._check_stop(req, token)
        if reason is None and req.grammar is not None and req.grammar.is_finished:
            reason = "grammar"  # complete and nothing may follow: stop without waiting for EOS
        if reason is None:
            return False
        if req.detokenizer is not None:
            req.output_text += req.detokenizer.finish() if reason != "stop_string" else ""
        self.scheduler.finish(req, "stop" if reason in ("eos", "stop_token", "stop_string", "grammar") else reason)
        req.finish_time = now
        finished.append(req)
        return True

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.params
        if req.detokenizer is not None:
            checked = len(req.output_text)
            req.output_text += req.detokenizer.push([token])
            if p.stop:
                idx = find_stop(req.output_text, p.stop, checked)
                if idx is not None:
                    hit = next(s for s in p.stop if req.output_text.startswith(s, idx))
                    req.output_text, req.stop_reason = req.output_text[:idx], hit
                    return "stop_string"
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos:
                req.stop_reason = token
                return "eos"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop_token"
        if (
            p.max_tokens is not None and n_out >= p.max_tokens
        ) or req.num_known_tokens >= self.scheduler.config.max_model_len:
            return "length"
        return None

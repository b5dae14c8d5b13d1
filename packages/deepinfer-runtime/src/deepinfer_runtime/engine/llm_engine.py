"""The engine loop: add requests, step (schedule -> run -> update), collect finished outputs."""

from __future__ import annotations

import time

from deepinfer_runtime.detokenizer import IncrementalDetokenizer, find_stop
from deepinfer_runtime.engine.model_runner import ModelRunner
from deepinfer_runtime.engine.request import Request
from deepinfer_runtime.engine.scheduler import Scheduler


class LLMEngine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, tokenizer, eos_token_ids: set[int]):
        self.scheduler, self.runner, self.tokenizer, self.eos = scheduler, runner, tokenizer, eos_token_ids
        self.num_steps = 0

    def add_request(self, req: Request) -> None:
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )
        self.scheduler.add(req)

    def step(self) -> list[Request]:
        """Run one step; return the requests that finished in it."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress: a request does not fit the KV cache budget")
            return []
        result = self.runner.execute(plan)
        self.num_steps += 1
        now = time.perf_counter()
        finished = []
        for chunk in plan.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            token = result.tokens.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.logprobs is not None:
                req.logprobs.append(result.logprobs[req.request_id])
            if req.request_id in result.sampled_logprob:
                req.cumulative_logprob += result.sampled_logprob[req.request_id]
            reason = self._check_stop(req, token)
            if reason is not None:
                if req.detokenizer is not None:
                    req.output_text += req.detokenizer.finish() if reason != "stop_string" else ""
                self.scheduler.finish(req, "stop" if reason in ("eos", "stop_token", "stop_string") else reason)
                req.finish_time = now
                finished.append(req)
        return finished

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
        ) or req.num_tokens >= self.scheduler.config.max_model_len:
            return "length"
        return None

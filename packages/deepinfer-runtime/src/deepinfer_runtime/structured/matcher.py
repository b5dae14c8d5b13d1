"""Per-request grammar state: which tokens may come next, advancing on each accepted token, rollback for
speculative decoding, and the trigger / bound-token span (see params.py for the semantics).

Phases: FREE (unconstrained: waiting for the trigger, or after a closed span with no trigger to re-arm),
CONSTRAINED (the llguidance matcher decides). Every accepted token is logged with what it changed, so
``rollback(n)`` can undo any n tokens, across phase changes too.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import Any

import torch

from deepinfer_runtime.structured.backend import GrammarError, _first_lines
from deepinfer_runtime.structured.params import GrammarSpec


class Phase(enum.Enum):
    FREE = "free"
    CONSTRAINED = "constrained"


class RequestGrammar:
    """One request's structured-output state.

    Args:
        spec: the request's GrammarSpec.
        compiled: a Future of the compiled template LLMatcher (backend.compile_async), or an exception when
            compilation could not even start (then ``error`` is set at once).
    """

    def __init__(self, spec: GrammarSpec, compiled: Future | BaseException):
        self.spec = spec
        self._future = compiled if isinstance(compiled, Future) else None
        self._template: Any = None
        self._matcher: Any = None
        self.error: str | None = None if self._future is not None else str(compiled)
        self.phase = Phase.FREE if spec.trigger_token_ids else Phase.CONSTRAINED
        self._tokens: list[int] = []  # every accepted token (trigger detection looks at the tail)
        self._log: list[tuple[Phase, Any, bool]] = []  # per token: (phase before, matcher before, fed to matcher)

    # ---------------------------------------------------------------- compilation
    def wait(self) -> bool:
        """Block until compiled; True when usable, False when ``error`` is set (the first sample waits here)."""
        if self._template is None and self.error is None:
            try:
                self._template = self._future.result()
            except GrammarError as exc:
                self.error = str(exc)
            except Exception as exc:  # anything else from the backend still only ends this request
                self.error = f"grammar compilation failed: {type(exc).__name__}: {exc}"
            else:
                self._matcher = self._template.deep_copy()
        return self.error is None

    @property
    def compiled(self) -> bool:
        """Compilation finished (successfully or not), without blocking."""
        return self._template is not None or self.error is not None or self._future.done()

    # ---------------------------------------------------------------- state
    @property
    def constrained(self) -> bool:
        """This step's token is constrained by the grammar (False while free or in error)."""
        return self.phase is Phase.CONSTRAINED and self.wait()

    @property
    def matcher(self):
        """The current llguidance matcher (compiled; only meaningful while constrained)."""
        self.wait()
        return self._matcher

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and cannot continue, and no bound token is expected: the request must stop."""
        return (
            self.phase is Phase.CONSTRAINED
            and self.spec.bound_token_id is None
            and self.error is None
            and self._matcher is not None
            and self._matcher.is_stopped()
        )

    def _bound_allowed(self) -> bool:
        return self.spec.bound_token_id is not None and self._matcher.is_accepting()

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (one token; use fill_bitmask for the whole vocabulary)."""
        if not self.constrained:
            return self.error is None
        if token == self.spec.bound_token_id and self._bound_allowed():
            return True
        if self.spec.bound_token_id is not None and self._matcher.is_stopped():
            return False  # only the bound token may close a finished span
        return self._matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> bool:
        """Advance by one sampled token. False (and ``error`` set) when the grammar rejects it."""
        if self.error is not None:
            return False
        if self.phase is Phase.FREE:
            self._tokens.append(token)
            self._log.append((Phase.FREE, None, False))
            trig = self.spec.trigger_token_ids
            if trig and tuple(self._tokens[-len(trig) :]) == trig and self.wait():
                self.phase, self._matcher = Phase.CONSTRAINED, self._template.deep_copy()
            # A compile error ends the request as soon as it is known, even before the trigger shows up.
            return self.wait() if self.compiled else True
        if not self.wait():
            return False
        if token == self.spec.bound_token_id and self._bound_allowed():
            self._tokens.append(token)
            self._log.append((Phase.CONSTRAINED, self._matcher, False))
            self.phase = Phase.FREE  # the span is closed; a trigger (if any) re-arms
            if not self.spec.trigger_token_ids:
                self._matcher = None
            return True
        if not self.allows(token) or not self._matcher.consume_token(token):
            self.error = f"token {token} violates the grammar"
            if self._matcher.is_error():
                self.error += f": {_first_lines(self._matcher.get_error())}"
            return False
        self._tokens.append(token)
        self._log.append((Phase.CONSTRAINED, None, True))
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding: rejected drafts)."""
        if not 0 <= n <= len(self._log):
            raise ValueError(f"rollback({n}) with {len(self._log)} tokens accepted")
        pending = 0  # consecutive matcher tokens, rolled back in one call
        for _ in range(n):
            phase, matcher_before, fed = self._log.pop()
            self._tokens.pop()
            if fed:
                pending += 1
                continue
            if pending:
                self._matcher.rollback(pending)
                pending = 0
            if phase is Phase.CONSTRAINED:  # undoing a bound token: back inside the span, matcher as it was
                self._matcher = matcher_before
            elif self.phase is Phase.CONSTRAINED:  # undoing the token that completed the trigger
                self._matcher = None
            self.phase = phase
        if pending:
            self._matcher.rollback(pending)

    def validate_drafts(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` (speculative drafts) the grammar allows; the state is unchanged."""
        n = 0
        for t in tokens:
            if not self.allows(t) or not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    # ---------------------------------------------------------------- masks
    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write this request's allowed tokens into ``row`` (int32 [W], CPU, contiguous; all ones when free)."""
        if not self.constrained:
            row.fill_(-1)
            return
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self.adjust_bitmask(row)

    def adjust_bitmask(self, row: torch.Tensor) -> None:
        """Add the bound token to a filled row where the span may close (only the bound token once finished)."""
        bound = self.spec.bound_token_id
        if bound is None:
            return
        if self._matcher.is_stopped():
            row.zero_()
        elif not self._matcher.is_accepting():
            return
        word, bit = divmod(bound, 32)
        # int32 view of bit 31 is negative: build the word in int64 and wrap to two's complement.
        value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value

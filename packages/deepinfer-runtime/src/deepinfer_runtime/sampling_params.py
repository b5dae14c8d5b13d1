"""Per-request sampling parameters: vLLM's names, DeepInfer's aliases, validated on construction.

Semantics of the fields in the sampler follow docs/model_v41_decisions.md section 4 (B2, B4); the
field list is the one vLLM users expect (docs/peer_engines.md, "Sampling params").

Aliases (constructor keywords; both spellings work, giving both with different values is an
error): ``seq_seed`` = ``seed`` (DeepInfer's name), ``top_logprobs`` = ``logprobs``.

Example::

    SamplingParams(temperature=0.6, top_p=0.95, max_tokens=256, seq_seed=1234, top_logprobs=5)
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from deepinfer_runtime.errors import DeepInferError

SAMPLING_EPS = 1e-5  # decisions B4.2: temperature below it = greedy (sampled at T = 1e-5)
UINT64_LIMIT = 1 << 64
PENALTY_LIMIT = 2.0  # presence / frequency penalties lie in [-2, 2] (vLLM, OpenAI)

ALIASES = {"seq_seed": "seed", "top_logprobs": "logprobs"}


class SamplingParamsError(DeepInferError, ValueError):
    """A SamplingParams field has an invalid value; the message names the field."""


def _fail(name: str, requirement: str, value: Any) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{name} must be {requirement}, got {value!r}")


def _int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (bool rejected, numpy integers accepted) in [minimum, maximum)."""
    bounds = f" in [{minimum}, {maximum})" if maximum is not None else f" >= {minimum}" if minimum is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, f"an int{bounds}", value)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value >= maximum):
        raise _fail(name, f"an int{bounds}", value)
    return value


def _float(name: str, value: Any) -> float:
    """A finite real number (bool rejected; NaN and infinities rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, "a finite number", value)
    value = float(value)
    if not math.isfinite(value):
        raise _fail(name, "a finite number", value)
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value)
    return value


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request (keyword arguments only).

    Attributes:
        n: number of output sequences (>= 1). The engine gives child j of a seeded request the seed
            (seed + j) mod 2^64, as vLLM does.
        temperature: >= 0; below 1e-5 (e.g. 0) means greedy: sampled at T = 1e-5 with top_p = 1,
            top_k off and min_p = 0, which __post_init__ writes back into those fields (decisions
            B4.2; vLLM does the same reset).
        top_p: nucleus mass in (0, 1]; 1 disables. Applied *before* top_k (decisions B4.3).
        top_k: number of tokens kept, >= 1; 0 or -1 disable it (both accepted and kept as given;
            vLLM's default is 0, DeepInfer's -1). Applied to the top-p survivors (B4.4).
        min_p: in [0, 1]; drop tokens less likely than min_p times the most likely one (applied
            right after temperature, as in vLLM). 0 disables.
        presence_penalty, frequency_penalty: in [-2, 2], on tokens of the output (vLLM semantics).
        repetition_penalty: > 0, on tokens of the prompt or the output; 1 disables.
        seed: uint64 in [0, 2^64) or None (alias ``seq_seed``). None: the engine derives a
            per-request seed from the LLM seed and the request index, so runs stay reproducible.
            DeepInfer reduces larger seeds modulo 2^64; here they are rejected (typo guard).
        max_tokens: output tokens at most (>= 1), or None for "until the context is full".
        min_tokens: >= 0 and <= max_tokens; until that many tokens are out, EOS (unless
            ignore_eos) and stop_token_ids are masked to -inf.
        stop: strings that end the output; normalised to a list (None -> []), no empty strings.
        stop_token_ids: token ids that end the output; normalised to a list (None -> []).
        ignore_eos: keep going past EOS (EOS is then not masked by min_tokens either).
        logprobs: number of top alternatives to return per output token (alias ``top_logprobs``);
            the sampled token's logprob is always returned too (vLLM). None: no logprobs. Values
            are DeepInfer's processed logprobs (log_softmax of the filtered, scaled logits; B4.5).
        prompt_logprobs: same, per prompt token; None: none.
        logit_bias: {token id: additive bias}, applied to the raw logits before penalties.
        skip_special_tokens: drop special tokens when detokenizing.
        structured_outputs: vLLM's structured outputs: a ``StructuredOutputsParams`` (or a dict of its fields:
            json, regex, choice, grammar, json_object, disable_any_whitespace, trigger_token_ids,
            bound_token_id), or None. See ``deepinfer_runtime.structured.params``.
        so_args: DeepInfer's form, ``{"schema_type": ..., "schema": ..., "trigger_token_ids": ...,
            "bound_token_id": ...}``, or None. Exclusive with structured_outputs; both normalise to
            ``grammar_spec`` (validated here, compiled by the engine when the request is added).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: Any = None  # StructuredOutputsParams | dict | None
    so_args: dict | None = None
    grammar_spec: Any = field(default=None, init=False, repr=False, compare=False)  # structured.GrammarSpec

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise _fail("temperature", ">= 0", self.temperature)
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise _fail("top_p", "in (0, 1]", self.top_p)
        self.top_k = _int("top_k", self.top_k, -1)
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise _fail("min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise _fail(name, f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]", value)
            setattr(self, name, value)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", "> 0", self.repetition_penalty)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, 0, UINT64_LIMIT)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        self.stop = self._stop_list(self.stop)
        self.stop_token_ids = self._token_list("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0)
        self.logit_bias = self._bias_dict(self.logit_bias)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        from deepinfer_runtime.structured.params import grammar_spec  # late: it imports this module

        self.grammar_spec = grammar_spec(self.structured_outputs, self.so_args)
        if self.greedy:  # decisions B4.2: set once, when the request is created
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _stop_list(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise _fail("stop", "a str, a list of str or None", stop)
        if any(s == "" for s in items):
            raise _fail("stop", "free of empty strings", stop)
        return list(items)

    @staticmethod
    def _token_list(name: str, ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise _fail(name, "a list of token ids (ints >= 0) or None", ids)
        return [_int(name, t, 0) for t in ids]

    @staticmethod
    def _bias_dict(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise _fail("logit_bias", "a dict {token id: bias} or None", bias)
        out: dict[int, float] = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise _fail("logit_bias", "keyed by token ids (ints >= 0)", token)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise _fail("logit_bias", f"finite numbers (token {int(token)})", value)
            out[int(token)] = float(value)
        return out

    @property
    def greedy(self) -> bool:
        """True when temperature < 1e-5 (decisions B4.2): argmax, up to ties broken by the seed."""
        return self.temperature < SAMPLING_EPS

    @property
    def seq_seed(self) -> int | None:
        """DeepInfer's name for ``seed``."""
        return self.seed

    @property
    def top_logprobs(self) -> int | None:
        """Alias of ``logprobs``."""
        return self.logprobs

    @property
    def top_k_enabled(self) -> bool:
        """top_k >= 1 (0 and -1 both mean "off")."""
        return self.top_k > 0


def _accept_aliases(init):
    """Wrap the generated __init__ so that alias keywords map onto their fields."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for alias, name in ALIASES.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if name in kwargs and kwargs[name] != value:
                    raise SamplingParamsError(
                        f"SamplingParams.{name}: {name}={kwargs[name]!r} and its alias {alias}={value!r} disagree"
                    )
                kwargs[name] = value
        init(self, *args, **kwargs)

    return __init__


SamplingParams.__init__ = _accept_aliases(SamplingParams.__init__)

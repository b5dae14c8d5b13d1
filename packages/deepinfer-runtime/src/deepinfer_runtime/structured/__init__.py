"""Structured outputs: constrain generation to a JSON schema, a regex, a Lark / EBNF grammar or a choice.

* ``params``: vLLM's ``StructuredOutputsParams`` and DeepInfer's ``so_args`` -> one ``GrammarSpec``;
* ``backend``: llguidance compilation in a thread pool, cached process-wide (optional dependency);
* ``matcher``: per-request state (``RequestGrammar``), trigger / bound-token spans, draft validation, rollback;
* ``mask``: the step's [B, ceil(V/32)] bitmask and its one vectorised application.
"""

from __future__ import annotations

from deepinfer_runtime.structured.backend import GrammarError, compile_async, import_llguidance, tokenizer_key
from deepinfer_runtime.structured.matcher import RequestGrammar
from deepinfer_runtime.structured.params import GrammarSpec, StructuredOutputsParams, parse_so_args


def start_grammar(spec: GrammarSpec, tokenizer, vocab_size: int, eos_token_ids) -> RequestGrammar:
    """A request's grammar state with its compilation started in the background (never raises: a failure
    is kept in ``RequestGrammar.error`` and ends only that request)."""
    try:
        import_llguidance()  # fail now, not in the pool, when it is not installed
        compiled = compile_async(spec, tokenizer_key(tokenizer, vocab_size, eos_token_ids))
    except GrammarError as exc:  # e.g. llguidance not installed
        compiled = exc
    return RequestGrammar(spec, compiled)


__all__ = [
    "GrammarError",
    "GrammarSpec",
    "RequestGrammar",
    "StructuredOutputsParams",
    "parse_so_args",
    "start_grammar",
]

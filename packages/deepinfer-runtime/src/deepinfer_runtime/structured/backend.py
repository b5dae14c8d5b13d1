"""Grammar compilation with llguidance: off the critical path (a thread pool, started when a request is added),
cached process-wide by the normalised spec, waited for only when the request is first sampled.

llguidance is an optional dependency (``pip install deepinfer-runtime[structured]``), imported lazily: without
it, only the requests that ask for structured outputs fail (with that advice), the rest run.

What is cached is a compiled, validated ``LLMatcher`` in its initial state; each request gets a ``deep_copy``
(cheap), so a schema used by 100 requests is compiled once. The llguidance tokenizer (about 1 s to build for
the 129k DeepSeek vocabulary) is cached per (tokenizer.json, vocabulary size, EOS ids).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer_runtime.errors import DeepInferError
from deepinfer_runtime.structured.params import GrammarSpec

INSTALL_HINT = "structured outputs need llguidance: pip install 'deepinfer-runtime[structured]'"
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


class GrammarError(DeepInferError, ValueError):
    """A request's schema / regex / grammar does not compile (or llguidance is missing); ends that request only."""


@dataclass(frozen=True)
class TokenizerKey:
    """Identifies an llguidance tokenizer: the tokenizer.json, the model's vocabulary size (>= the tokenizer's;
    rows beyond the tokenizer's vocabulary are never allowed) and the EOS ids the grammar may end with."""

    tokenizer_json: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def tokenizer_key(tokenizer: Any, vocab_size: int, eos_token_ids) -> TokenizerKey:
    """Key for a ``deepinfer_runtime.tokenizer.Tokenizer`` (its directory's tokenizer.json)."""
    return TokenizerKey(
        str(Path(tokenizer.directory) / "tokenizer.json"), int(vocab_size), tuple(sorted(eos_token_ids))
    )


def import_llguidance():
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarError(INSTALL_HINT) from exc
    return llguidance


_LOCK = threading.Lock()
_TOKENIZERS: dict[TokenizerKey, Any] = {}
_TOKENIZER_LOCKS: dict[TokenizerKey, threading.Lock] = {}
_COMPILED: OrderedDict[tuple, Future] = OrderedDict()
_POOL: ThreadPoolExecutor | None = None
_EXECUTOR: Any = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            # llguidance drops the GIL while it builds lexers, so a few threads compile in parallel with the model.
            _POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="deepinfer-grammar")
        return _POOL


def ll_executor():
    """The process-wide llguidance executor that fills many bitmask rows in parallel (Rust threads)."""
    global _EXECUTOR
    with _LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = import_llguidance().LLExecutor()
        return _EXECUTOR


def ll_tokenizer(key: TokenizerKey):
    """The llguidance tokenizer for ``key`` (built once; concurrent callers wait for the first)."""
    with _LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is not None:
            return tok
        lock = _TOKENIZER_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _TOKENIZERS:
            llg = import_llguidance()
            text = Path(key.tokenizer_json).read_text(encoding="utf-8")
            n_vocab = json_vocab_size(text)
            if n_vocab > key.vocab_size:
                raise GrammarError(f"tokenizer has {n_vocab} tokens, more than the model's {key.vocab_size}")
            # n_vocab = the model's vocabulary: the bitmask then has the logits' width and padded rows stay 0.
            tok = llg.LLTokenizer(text, n_vocab=key.vocab_size, eos_token=list(key.eos_token_ids))
            with _LOCK:
                _TOKENIZERS[key] = tok
        return _TOKENIZERS[key]


def json_vocab_size(tokenizer_json: str) -> int:
    """1 + the largest id in a tokenizer.json (model vocabulary and added tokens)."""
    spec = json.loads(tokenizer_json)
    ids = list(spec.get("model", {}).get("vocab", {}).values()) + [t["id"] for t in spec.get("added_tokens", [])]
    return max(ids) + 1 if ids else 0


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (JSON text) for a spec; raises GrammarError on text it cannot even parse."""
    llg = import_llguidance()
    m = llg.LLMatcher
    try:
        if spec.kind == "json":
            return m.grammar_from_json_schema(spec.spec, defaults={"whitespace_flexible": spec.whitespace_flexible})
        if spec.kind == "regex":
            return m.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # An alternation of string literals; JSON string escapes are valid Lark literals in llguidance.
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec.spec)))
        from llguidance.gbnf_to_lark import any_to_lark  # Lark passes through, GBNF is converted

        return m.grammar_from_lark(any_to_lark(spec.spec))
    except GrammarError:
        raise
    except Exception as exc:  # llguidance raises ValueError and friends on malformed text
        raise GrammarError(f"invalid {spec.kind} grammar: {exc}") from None


def _first_lines(message: str) -> str:
    """llguidance appends its parser state and the whole grammar to errors; keep the message itself."""
    return message.split("\n<state>")[0].split("\n<grammar>")[0].strip()


def compile_matcher(spec: GrammarSpec, key: TokenizerKey):
    """A validated LLMatcher in its initial state (blocking; raises GrammarError)."""
    llg = import_llguidance()
    tokenizer = ll_tokenizer(key)
    matcher = llg.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {spec.kind} grammar: {_first_lines(matcher.get_error())}")
    return matcher


def compile_async(spec: GrammarSpec, key: TokenizerKey) -> Future:
    """Future of ``compile_matcher(spec, key)``, shared by all requests with the same compile key."""
    cache_key = (spec.compile_key, key)
    with _LOCK:
        fut = _COMPILED.get(cache_key)
        if fut is not None:
            _COMPILED.move_to_end(cache_key)
            return fut
    fut = _pool().submit(compile_matcher, spec, key)
    with _LOCK:
        fut = _COMPILED.setdefault(cache_key, fut)
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return fut


def clear_cache() -> None:
    """Forget compiled grammars (tests, benchmarks)."""
    with _LOCK:
        _COMPILED.clear()

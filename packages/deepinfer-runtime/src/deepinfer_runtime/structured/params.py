"""What a request asks its output to match: vLLM's ``StructuredOutputsParams`` and DeepInfer's ``so_args``,
both normalised to one frozen ``GrammarSpec`` (the compile-cache key plus the trigger / bound tokens).

vLLM's shape (exactly one of json, regex, choice, grammar, json_object)::

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))
    SamplingParams(structured_outputs={"regex": r"\\d{3}-\\d{4}"})          # a dict works too

DeepInfer's shape::

    SamplingParams(so_args={"schema_type": "json_schema", "schema": {...}, "trigger_token_ids": [...]})

``schema_type`` names (DeepInfer's own list is not public; these are the names vLLM, SGLang and llguidance
use for the same things): "json" / "json_schema" (schema: dict or JSON text), "json_object" (any JSON
object; schema omitted), "regex", "ebnf" / "grammar" / "lark" / "gbnf" (a Lark grammar or a llama.cpp GBNF
grammar; llguidance accepts both), "choice" (schema: list of strings). Other keys: "trigger_token_ids",
"bound_token_id", "disable_any_whitespace". ``so_args`` without "schema_type" may also use vLLM's field names
(``{"json": {...}}``, ``{"regex": "...", "trigger_token_ids": [...]}``).

Span semantics (both shapes):

* ``trigger_token_ids``: generation is free until the output *ends with* this token sequence; the grammar
  then applies to the tokens that follow (the trigger itself is not part of the grammar's text).
* ``bound_token_id``: the token that closes the constrained span. It is allowed wherever the grammar may end
  (and is the only token allowed once the grammar cannot continue); it is not fed to the grammar. After it
  generation is free again, and with a trigger the trigger re-arms (another span may follow). Without a
  bound token a finished grammar finishes the request (finish_reason "stop").
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from deepinfer_runtime.sampling_params import SamplingParamsError

GrammarKind = Literal["json", "regex", "lark", "choice"]

SO_ARGS_SCHEMA_TYPES: dict[str, GrammarKind] = {
    "json": "json",
    "json_schema": "json",
    "json_object": "json",
    "regex": "regex",
    "ebnf": "lark",
    "grammar": "lark",
    "lark": "lark",
    "gbnf": "lark",
    "choice": "choice",
}
_SO_ARGS_KEYS = {"schema_type", "schema", "trigger_token_ids", "bound_token_id", "disable_any_whitespace"}
_ANY_OBJECT = '{"type":"object"}'


def _err(field: str, requirement: str, value: Any) -> SamplingParamsError:
    return SamplingParamsError(f"SamplingParams.{field} must be {requirement}, got {value!r}")


@dataclass(frozen=True)
class GrammarSpec:
    """The one internal form. ``kind`` + ``spec`` (+ ``whitespace_flexible`` for JSON) is what gets compiled
    and cached; the trigger and bound tokens only steer when the grammar applies.

    Attributes:
        kind: "json" (spec: a JSON schema as canonical JSON text), "regex", "lark" (Lark or GBNF text),
            "choice" (spec: a JSON list of strings).
        whitespace_flexible: JSON only: allow free whitespace between JSON tokens (vLLM's default); False
            gives compact JSON (``disable_any_whitespace``).
        trigger_token_ids: () or the token sequence after which the grammar applies.
        bound_token_id: None or the token that closes the constrained span.
    """

    kind: GrammarKind
    spec: str
    whitespace_flexible: bool = True
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    @property
    def compile_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec, self.whitespace_flexible if self.kind == "json" else True)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output request (field names as in vLLM >= 0.12); set exactly one of json, regex,
    choice, grammar, json_object. ``trigger_token_ids`` / ``bound_token_id`` are DeepInfer's (see module doc).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    trigger_token_ids: list[int] | None = None
    bound_token_id: int | None = None

    def to_spec(self, field: str = "structured_outputs") -> GrammarSpec:
        """Validate and normalise; errors name ``SamplingParams.<field>.<name>``."""
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                f"SamplingParams.{field} must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise _err(f"{field}.disable_any_whitespace", "a bool", self.disable_any_whitespace)
        kind, spec = _normalise(given[0], getattr(self, given[0]), f"{field}.{given[0]}")
        return GrammarSpec(
            kind,
            spec,
            not self.disable_any_whitespace,
            _trigger(f"{field}.trigger_token_ids", self.trigger_token_ids),
            _token(f"{field}.bound_token_id", self.bound_token_id),
        )


def _normalise(name: str, value: Any, field: str) -> tuple[GrammarKind, str]:
    """(kind, spec text) of one vLLM-style field."""
    if name == "json_object":
        return "json", _ANY_OBJECT
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise _err(field, f"a JSON schema (dict or JSON text that parses: {exc})", value) from None
        if not isinstance(value, dict | bool):
            raise _err(field, "a JSON schema (dict or JSON text)", value)
        # Canonical text: the same schema spelled with other key order or spacing hits the same cache entry.
        return "json", json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if name == "choice":
        if not isinstance(value, list | tuple) or not value or not all(isinstance(c, str) and c for c in value):
            raise _err(field, "a non-empty list of non-empty strings", value)
        return "choice", json.dumps(list(value), ensure_ascii=False)
    if not isinstance(value, str) or not value.strip():
        raise _err(field, "a non-empty str", value)
    return ("regex" if name == "regex" else "lark"), value


def _token(field: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _err(field, "a token id (int >= 0) or None", value)
    return int(value)


def _trigger(field: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not value:
        raise _err(field, "a non-empty list of token ids or None", value)
    return tuple(_token(field, t) for t in value)


def parse_so_args(so_args: dict) -> GrammarSpec:
    """DeepInfer's ``so_args`` dict -> GrammarSpec (errors name ``SamplingParams.so_args.<key>``)."""
    if "schema_type" not in so_args and so_args and set(so_args) <= _VLLM_FIELDS:
        # Also accepted: so_args spelled with vLLM's field names, e.g. {"json": {...}} (errors name so_args).
        try:
            return StructuredOutputsParams(**so_args).to_spec("so_args")
        except TypeError:
            raise _err("so_args", "a dict", so_args) from None
    unknown = set(so_args) - _SO_ARGS_KEYS
    if unknown:
        raise _err("so_args", f"a dict with keys among {sorted(_SO_ARGS_KEYS)}", sorted(unknown))
    schema_type = so_args.get("schema_type")
    if schema_type not in SO_ARGS_SCHEMA_TYPES:
        raise _err("so_args.schema_type", f"one of {sorted(SO_ARGS_SCHEMA_TYPES)}", schema_type)
    schema = so_args.get("schema")
    if schema_type == "json_object":
        params = StructuredOutputsParams(json_object=True)
    else:
        if schema is None:
            raise _err("so_args.schema", f"given for schema_type {schema_type!r}", None)
        field = {"json": "json", "regex": "regex", "lark": "grammar", "choice": "choice"}[
            SO_ARGS_SCHEMA_TYPES[schema_type]
        ]
        params = StructuredOutputsParams(**{field: schema})
    params.trigger_token_ids = so_args.get("trigger_token_ids")
    params.bound_token_id = so_args.get("bound_token_id")
    params.disable_any_whitespace = so_args.get("disable_any_whitespace", False)
    try:
        return params.to_spec("so_args")
    except SamplingParamsError as exc:  # name DeepInfer's key, not vLLM's field
        msg = str(exc)
        for vllm_name in ("json", "regex", "grammar", "choice"):
            msg = msg.replace(f"so_args.{vllm_name} ", "so_args.schema ")
        raise SamplingParamsError(msg) from None


_VLLM_FIELDS = set(StructuredOutputsParams.__dataclass_fields__)


def grammar_spec(structured_outputs: Any, so_args: Any) -> GrammarSpec | None:
    """The GrammarSpec of a SamplingParams (None when neither field is set); they are mutually exclusive."""
    if structured_outputs is not None and so_args is not None:
        raise SamplingParamsError("SamplingParams.structured_outputs and SamplingParams.so_args: give one, not both")
    if so_args is not None:
        if not isinstance(so_args, dict):
            raise _err("so_args", "a dict or None", so_args)
        return parse_so_args(so_args)
    if structured_outputs is None:
        return None
    if isinstance(structured_outputs, dict):
        try:
            structured_outputs = StructuredOutputsParams(**structured_outputs)
        except TypeError:
            raise _err(
                "structured_outputs", "a StructuredOutputsParams or a dict of its fields", structured_outputs
            ) from None
    if not isinstance(structured_outputs, StructuredOutputsParams):
        raise _err("structured_outputs", "a StructuredOutputsParams, a dict or None", structured_outputs)
    return structured_outputs.to_spec()

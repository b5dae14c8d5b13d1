"""Structured outputs: both request shapes, the per-request grammar state (trigger, bound token, drafts), and
the engine end to end on the tiny V4.1 checkpoint with random weights (sampled at temperature 1, seeded).

Random weights wander, so the schemas are finite (enums, bounded integers, short strings, no extra properties)
and JSON is compact (``disable_any_whitespace``): a random model would otherwise write whitespace forever.
"""

import json
import re

import pytest
import torch
from deepinfer_runtime import LLM, SamplingParams
from deepinfer_runtime.llm import default_model_dir
from deepinfer_runtime.sampling_params import SamplingParamsError
from deepinfer_runtime.structured import GrammarSpec, StructuredOutputsParams, start_grammar
from deepinfer_runtime.tokenizer import Tokenizer

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2,4}-[a-f]{1,3}"
LARK = 'start: pair ("," pair)~0..2\npair: KEY "=" NUM\nKEY: "x" | "y" | "z"\nNUM: /[0-9]{1,3}/'
GBNF = 'root ::= pair ("," pair)? ("," pair)?\npair ::= [xyz] "=" [0-9] [0-9]? [0-9]?'
PAIRS = r"[xyz]=[0-9]{1,3}(,[xyz]=[0-9]{1,3}){0,2}"
EOS = {1}


def _check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "color", "ok"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6, text
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120, text
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["ok"], bool), text


# ------------------------------------------------------------------ params
def test_both_shapes_map_to_one_form():
    a = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, trigger_token_ids=[5, 6]))
    b = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA, indent=2), "trigger_token_ids": [5, 6]})
    c = SamplingParams(so_args={"schema_type": "json_schema", "schema": SCHEMA, "trigger_token_ids": [5, 6]})
    assert a.grammar_spec == b.grammar_spec == c.grammar_spec
    assert a.grammar_spec.kind == "json" and a.grammar_spec.trigger_token_ids == (5, 6)
    r1 = SamplingParams(structured_outputs={"regex": REGEX, "bound_token_id": 9}).grammar_spec
    r2 = SamplingParams(so_args={"schema_type": "regex", "schema": REGEX, "bound_token_id": 9}).grammar_spec
    r3 = SamplingParams(so_args={"regex": REGEX, "bound_token_id": 9}).grammar_spec  # so_args with vLLM's names
    assert r1 == r2 == r3 == GrammarSpec("regex", REGEX, True, (), 9)
    g1 = SamplingParams(structured_outputs={"grammar": LARK}).grammar_spec
    assert g1 == SamplingParams(so_args={"schema_type": "ebnf", "schema": LARK}).grammar_spec
    ch = SamplingParams(structured_outputs={"choice": ["yes", "no"]}).grammar_spec
    assert ch == SamplingParams(so_args={"schema_type": "choice", "schema": ["yes", "no"]}).grammar_spec
    assert SamplingParams(structured_outputs={"json_object": True}).grammar_spec.spec == '{"type":"object"}'
    assert SamplingParams().grammar_spec is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(structured_outputs={"regex": ""}), "structured_outputs.regex"),
        (dict(structured_outputs={"json": "{not json"}), "structured_outputs.json"),
        (dict(structured_outputs={"choice": []}), "structured_outputs.choice"),
        (dict(structured_outputs={"regex": "a", "grammar": "b"}), "structured_outputs must set exactly one"),
        (dict(structured_outputs={}), "structured_outputs must set exactly one"),
        (dict(structured_outputs={"regex": "a", "trigger_token_ids": [-1]}), "structured_outputs.trigger_token_ids"),
        (dict(structured_outputs={"regex": "a", "bound_token_id": True}), "structured_outputs.bound_token_id"),
        (dict(structured_outputs={"regexp": "a"}), "structured_outputs"),
        (dict(structured_outputs=5), "structured_outputs"),
        (dict(so_args={"schema_type": "yaml", "schema": "a"}), "so_args.schema_type"),
        (dict(so_args={"schema_type": "regex"}), "so_args.schema"),
        (dict(so_args={"schema_type": "regex", "schema": 5}), "so_args.schema"),
        (dict(so_args={"schema_type": "regex", "schema": "a", "trigger": [1]}), "so_args"),
        (dict(so_args={"schema_type": "regex", "schema": "a", "trigger_token_ids": []}), "so_args.trigger_token_ids"),
        (dict(so_args=["regex"]), "so_args"),
        (dict(so_args={"schema_type": "regex", "schema": "a"}, structured_outputs={"regex": "a"}), "give one"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=re.escape(field)):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------ grammar state (real tokenizer, no model)
@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_dir())


def _grammar(tokenizer, vocab=None, **so):
    spec = SamplingParams(structured_outputs=so).grammar_spec
    g = start_grammar(spec, tokenizer, vocab or tokenizer.vocab_size, EOS)
    assert g.wait(), g.error
    return g


def _allowed(g, vocab) -> set[int]:
    row = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    g.fill_bitmask(row)
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(bits.nonzero().flatten().tolist())


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_bos=False)


def test_trigger_bound_drafts_and_rollback(tokenizer):
    trig = _ids(tokenizer, "<call>")
    bound = 2
    g = _grammar(tokenizer, regex="[0-9]{2}", trigger_token_ids=trig, bound_token_id=bound)
    v = tokenizer.vocab_size
    assert len(_allowed(g, v)) == v, "free before the trigger"
    for t in _ids(tokenizer, "hello ") + trig:
        assert g.accept(t)
    allowed = _allowed(g, v)
    assert allowed and all(re.fullmatch(r"[0-9]{1,2}", tokenizer.decode([t])) for t in allowed)
    digits = _ids(tokenizer, "42")
    n_before = len(g._tokens)
    assert g.validate_drafts([*digits, bound, 77, 5]) == len(digits) + 3, "drafts after the bound token are free"
    assert len(g._tokens) == n_before, "validate_drafts leaves the state unchanged"
    assert g.validate_drafts([*_ids(tokenizer, "x")]) == 0
    for t in digits:
        assert g.accept(t)
    assert _allowed(g, v) == {bound}, "a finished span with a bound token allows only the bound token"
    assert not g.is_finished
    assert g.accept(bound)
    assert len(_allowed(g, v)) == v, "free again after the bound token"
    g.rollback(1 + len(digits) + len(trig))  # back before the trigger
    assert len(_allowed(g, v)) == v
    for t in trig + digits:
        assert g.accept(t)
    assert _allowed(g, v) == {bound}


def test_finished_grammar_and_eos(tokenizer):
    g = _grammar(tokenizer, regex="[0-9]{1,2}")
    v = tokenizer.vocab_size
    for t in _ids(tokenizer, "7"):
        assert g.accept(t)
    assert 1 in _allowed(g, v), "EOS is allowed where the grammar may stop"
    assert not g.is_finished
    for t in _ids(tokenizer, "3"):
        assert g.accept(t)
    assert g.is_finished and _allowed(g, v) == {1}
    assert not g.accept(_ids(tokenizer, "5")[0]) and "violates" in g.error


def test_model_vocab_larger_than_tokenizer(tokenizer):
    v = tokenizer.vocab_size + 100  # padded embedding rows: never allowed
    g = _grammar(tokenizer, vocab=v, choice=["alpha", "beta"])
    allowed = _allowed(g, v)
    assert allowed and max(allowed) < tokenizer.vocab_size
    free = _grammar(tokenizer, vocab=v, regex=".{0,3}")
    assert max(_allowed(free, v)) < tokenizer.vocab_size


# ------------------------------------------------------------------ engine, tiny V4.1 with random weights
def _so(i, max_tokens, **kw):
    return SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def run():
    """One generate call for every engine case (the steps are what cost time): 100 JSON requests, regex, Lark,
    GBNF, choice, trigger, two invalid grammars and an unconstrained request; plus that request alone."""
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=160, max_num_batched_tokens=2048, log_stats=False)
    trig = _ids(llm.tokenizer, "@")
    assert len(trig) == 1
    free = SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["unconstrained"], free, use_tqdm=False)[0].outputs[0].token_ids
    json_so = {"json": SCHEMA, "disable_any_whitespace": True}
    cases = (
        [("json", _so(i, 40, structured_outputs=json_so)) for i in range(100)]
        + [("regex", _so(i, 16, structured_outputs={"regex": REGEX})) for i in range(12)]
        + [("lark", _so(i, 24, so_args={"schema_type": "ebnf", "schema": LARK})) for i in range(8)]
        + [("gbnf", _so(i, 24, structured_outputs={"grammar": GBNF})) for i in range(8)]
        + [("choice", _so(i, 8, structured_outputs={"choice": ["yes", "no", "maybe so"]})) for i in range(6)]
        + [
            # logits have std ~1 over 129k tokens: +12 gives the trigger p ~ 1/3 per free token (then masked)
            (
                "trigger",
                _so(
                    i,
                    24,
                    logit_bias={trig[0]: 12.0},
                    so_args={"schema_type": "regex", "schema": REGEX, "trigger_token_ids": trig},
                ),
            )
            for i in range(10)
        ]
        + [
            ("bad_regex", SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-"})),
            ("bad_schema", SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "nonsense"}})),
            ("free", free),
        ]
    )
    prompts = [f"Describe item {i}:" if k != "free" else "unconstrained" for i, (k, _) in enumerate(cases)]
    outs = llm.generate(prompts, [p for _, p in cases], use_tqdm=False)
    return llm.tokenizer, trig, alone, [(kind, o) for (kind, _), o in zip(cases, outs)]


def test_100_json_requests_validate(run):
    _, _, _, results = run
    texts = []
    for kind, o in results:
        if kind == "json":
            assert o.error is None and o.outputs[0].finish_reason == "stop", (
                o.outputs[0].finish_reason,
                o.outputs[0].text,
            )
            _check_schema(o.outputs[0].text)
            texts.append(o.outputs[0].text)
    assert len(texts) == 100 and len(set(texts)) > 50, "seeded sampling at T=1 should vary"


def test_regex_lark_gbnf_choice(run):
    for kind, o in run[3]:
        pattern = {"regex": REGEX, "lark": PAIRS, "gbnf": PAIRS, "choice": "yes|no|maybe so"}.get(kind)
        if pattern is not None:
            c = o.outputs[0]
            assert o.error is None and c.finish_reason == "stop", (kind, c.finish_reason, c.text)
            assert re.fullmatch(pattern, c.text), (kind, c.text)


def test_trigger_free_before_constrained_after(run):
    tok, trig, _, results = run
    triggered, free_before = 0, 0
    for kind, o in results:
        ids = o.outputs[0].token_ids
        if kind == "trigger" and trig[0] in ids:
            k = ids.index(trig[0])
            triggered += 1
            free_before += k > 0
            assert re.fullmatch(REGEX, tok.decode(ids[k + 1 :])), tok.decode(ids)
    assert triggered >= 5 and free_before >= 1, (triggered, free_before)


def test_invalid_grammar_fails_only_that_request(run):
    for kind, o in run[3]:
        if kind.startswith("bad"):
            assert o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == [], o
            assert "invalid" in o.error, o.error
        else:
            assert o.error is None


def test_mask_leaves_unconstrained_rows_bitwise_alone(run):
    """Batch invariance: an unconstrained request samples the same tokens alone and among structured ones."""
    _, _, alone, results = run
    (free,) = [o for kind, o in results if kind == "free"]
    assert free.outputs[0].token_ids == alone

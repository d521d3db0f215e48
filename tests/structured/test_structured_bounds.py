"""Hostile constraints (issue 41): JSON texts nested or numbered past the bounds, constraints too large to read,
and regexes whose counted repetitions multiply, each refused with a GrammarError naming its field before
llguidance parses, converts or compiles it, so a victim's request never shares a step with one."""

from __future__ import annotations

import json
from functools import partial

import llguidance
import pytest

from paged_jax.bounded_json import MAX_DEPTH, bounded_dumps
from paged_jax.errors import FieldError
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import GrammarError, LLGuidanceBackend, StructuredLimits
from paged_jax.structured.regex_bounds import lark_regexes, lark_schemas, regex_expansion, schema_patterns
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.tokenization.tool_calls import FORMATS

from support.engines import make_engine as _make_engine

DEEP = "[" * 3000 + "]" * 3000
DIGITS = "7" * 5000
BOMB = "(a{700}){700}"  # 490,000 atoms written out: compiles in milliseconds, then seconds per mask
make_engine = partial(_make_engine, max_num_seqs=16)


def backend(**limits) -> LLGuidanceBackend:
    return LLGuidanceBackend(ByteTokenizer(), 320, (2,), StructuredLimits(**limits))


def _schema_with(pattern: str) -> dict:
    return {"type": "object", "properties": {"x": {"type": "string", "pattern": pattern}}}


def _deep_dict(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


TAG = {"structures": [{"begin": "<f>", "schema": _schema_with(BOMB), "end": "</f>"}], "triggers": ["<f>"]}
HOSTILE = {  # name: (constraint, the field its GrammarError names, words of its message)
    "json-text-nested": (StructuredOutputs(json=DEEP), "structured_outputs.json", "nested deeper"),
    "json-dict-nested": (StructuredOutputs(json=_deep_dict(5000)), "structured_outputs.json", "nested deeper"),
    "json-text-digits": (
        StructuredOutputs(json='{"type": "integer", "maximum": ' + DIGITS + "}"),
        "structured_outputs.json.maximum",
        "5000 digits",
    ),
    "tag-text-nested": (StructuredOutputs(structural_tag=DEEP), "structured_outputs.structural_tag", "nested deeper"),
    "regex-bomb": (StructuredOutputs(regex=BOMB), "structured_outputs.regex", "expands to more than 10000"),
    "pattern-bomb": (
        StructuredOutputs(json=_schema_with(BOMB)),
        "structured_outputs.json.properties.x.pattern",
        "expands",
    ),
    "pattern-key-bomb": (
        StructuredOutputs(json={"type": "object", "patternProperties": {BOMB: {}}}),
        "structured_outputs.json.patternProperties",
        "expands",
    ),
    "tag-pattern-bomb": (
        StructuredOutputs(structural_tag=TAG),
        "structured_outputs.structural_tag.structures[0].schema.properties.x.pattern",
        "expands",
    ),
    "lark-regex-bomb": (StructuredOutputs(grammar=f'start: "x" /{BOMB}/'), "structured_outputs.grammar", "expands"),
    "tool-parameters-bomb": (
        FORMATS["hermes"].grammar({"f": _schema_with(BOMB)}),
        "structured_outputs.grammar.properties.arguments.properties.x.pattern",
        "expands",
    ),
    "llama3-tool-parameters-bomb": (
        FORMATS["llama3"].grammar({"f": _schema_with(BOMB)}),
        "structured_outputs.json.properties.parameters.properties.x.pattern",
        "expands",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_constraints_are_refused_before_compiling(case, monkeypatch):
    spec, field, words = HOSTILE[case]
    b = backend()
    compiled = []
    monkeypatch.setattr(b, "_compile", lambda *a: compiled.append(a))  # a compile would be recorded
    with pytest.raises(GrammarError) as e:
        b.matcher(spec)
    assert e.value.field == field, e.value
    assert words in e.value.message and "Traceback" not in e.value.message
    assert not compiled


def test_size_is_checked_before_the_schema_is_parsed_or_converted(monkeypatch):
    """A multi-MB schema is refused by its length, before json parsing or llguidance's conversion."""
    converted = []
    real = llguidance.LLMatcher.grammar_from_json_schema
    monkeypatch.setattr(
        llguidance.LLMatcher, "grammar_from_json_schema", lambda *a, **k: converted.append(1) or real(*a, **k)
    )
    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(200_000)}}
    b = backend()
    for spec in (StructuredOutputs(json=json.dumps(big)), StructuredOutputs(json=big)):
        with pytest.raises(GrammarError, match=r"structured_outputs.json: .*65536"):
            b.matcher(spec)
    assert not converted
    b.matcher(StructuredOutputs(json={"type": "object"}))
    assert converted == [1]


def test_bounded_dumps_never_walks_past_the_limit():
    assert bounded_dumps({"a": [1, 2.5, None, True, "x"]}, "f", 100) == json.dumps({"a": [1, 2.5, None, True, "x"]})
    exact = json.dumps({"k": "v" * 50})
    assert bounded_dumps({"k": "v" * 50}, "f", len(exact)) == exact  # the estimate never exceeds the real size
    with pytest.raises(FieldError, match="more than 10 bytes"):
        bounded_dumps({"k": "v" * 50}, "f", 10)
    with pytest.raises(FieldError, match="nested deeper"):
        bounded_dumps(_deep_dict(MAX_DEPTH), "f", 10**6)
    with pytest.raises(FieldError, match="2\\^64"):
        bounded_dumps({"k": 10**5000}, "f", 10**6)
    with pytest.raises(FieldError, match="nan is not a JSON number"):
        bounded_dumps([float("nan")], "f", 10**6)


@pytest.mark.parametrize(
    ("regex", "atoms"),
    [
        ("(a{700}){700}", 10_001),  # saturated at the bound + 1
        ("(a{100}){100}", 10_000),
        ("((a{10}){10}){10}", 1000),
        ("a{9999}", 9999),
        ("(a|b{100}){100}", 10_001),  # alternatives add up inside the repetition
        ("[a-z]+x*", 2),  # loops are not copies
        (r"\p{L}{5}[]a]{3}\d{3}-\w{2}", 14),  # escapes with braces and classes are single atoms
        ("a{2,}b{,5}", 2 + 5),  # {m,} counts m; {,5} is no quantifier in Rust (literal text)
        ("x{99999999999}", 10_001),  # a count of many digits saturates
        ("(ab", 2),  # an unclosed group still counts
    ],
)
def test_regex_expansion(regex, atoms):
    assert regex_expansion(regex, 10_000) == atoms


def test_regexes_and_schemas_are_found_where_llguidance_compiles_them():
    grammar = 'start: "a" /x{3}/i b\nb: %json {"type": "string", "pattern": "y{2}"}\n'
    assert lark_regexes(grammar) == ["x{3}"]
    assert schema_patterns(lark_schemas(grammar)[0]) == [(".pattern", "y{2}")]
    with pytest.raises(ValueError, match="nests too deep"):
        lark_schemas("start: %json " + '{"a": ' * 5000)


def test_constraints_within_the_bounds_still_compile():
    b = backend()
    for spec in (
        StructuredOutputs(regex="(a{100}){100}"),
        StructuredOutputs(json=_schema_with("^[a-z]{3,30}$")),
        StructuredOutputs(json=json.dumps(_deep_dict(MAX_DEPTH // 2 - 1))),
        StructuredOutputs(grammar='start: "x" /[0-9]{3}/'),
    ):
        assert not b.matcher(spec).error


def test_a_hostile_constraint_never_reaches_a_victims_steps(tiny_config, tiny_params, monkeypatch):
    """Machine-speed independent isolation: every hostile constraint is refused in `add_request`, so the victim's
    steps fill no bitmask and compile no grammar, and the victim's tokens are those it gets alone."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    alone = make_engine(tiny_config, tiny_params)
    alone.add_request("victim", [5, 6, 7], params)
    engine = make_engine(tiny_config, tiny_params)
    compiled = []
    monkeypatch.setattr(engine.structured.backend, "_compile", lambda *a: compiled.append(a))
    engine.add_request("victim", [5, 6, 7], params)
    for i, (spec, _, _) in enumerate(HOSTILE.values()):
        with pytest.raises(GrammarError):
            engine.add_request(f"hostile-{i}", "x", SamplingParams(max_tokens=8, n=16, structured_outputs=spec))
    assert _final_tokens(engine) == _final_tokens(alone)
    assert engine.structured.fill_rows == 0 and not compiled
    assert engine.kv.stats().pages_in_use == 0


def _final_tokens(engine) -> dict[str, list[int]]:
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out

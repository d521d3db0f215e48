"""The llguidance grammar backend: JSON Schema, regex, choice, Lark / GBNF grammars and structural tags.

llguidance (guidance-ai's Rust library, numpy API) builds its token trie from the model's own tokenizer: the
`tokenizer.json` of an HF directory, or the one rebuilt from GGUF metadata (both are `HFTokenizer`s); the
byte tokenizer of the `tiny` config is described token by token. A compiled grammar costs about a millisecond;
a mask is computed lazily over the token trie, and `fill` computes a step's rows in parallel on llguidance's
own threads (`LLExecutor`), with the GIL released.

JSON is generated compactly (`", "` and `": "` between items, no free whitespace elsewhere): a model left free
whitespace can emit it forever and never close the object. Hostile constraints are bounded by
`StructuredLimits`: the text's size before anything parses or converts it, a JSON text's depth and numbers
while it is parsed, the expansion of every regex (counted repetitions written out) before it compiles,
llguidance's fuel limits while compiling and per mask, and a wall-clock timeout on the compile (run on a
worker thread; the request is refused when it passes).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from paged_jax.bounded_json import bounded_dumps, load_json
from paged_jax.errors import FieldError
from paged_jax.sampling_params import StructuredOutputs
from paged_jax.structured.backend import GrammarError, StructuredLimits
from paged_jax.structured.bitmask import all_allowed
from paged_jax.structured.regex_bounds import lark_regexes, lark_schemas, regex_expansion, schema_patterns
from paged_jax.tokenization.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the extension's stub only

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}  # `json=True` (OpenAI's json_object)


class LLGuidanceMatcher:
    """`paged_jax.structured.backend.Matcher` over an `llguidance.LLMatcher`."""

    __slots__ = ("_m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        return self._m.consume_token(int(token))

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy())

    @property
    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error() if self._m.is_error() else ""


def _byte_tokenizer_wrapper(tok: ByteTokenizer, vocab_size: int) -> llguidance.TokenizerWrapper:
    """The byte tokenizer token by token over `vocab_size` ids: byte b is token offset + b; every other id
    (pad, BOS, EOS, unused, padding) is a named special token that no grammar text matches."""

    class _Tokens:
        eos_token_id = tok.eos_token_ids[0]
        bos_token_id = tok.bos_token_id
        tokens = [b"<|special_%d|>" % i for i in range(vocab_size)]
        special_token_ids = [i for i in range(vocab_size) if not tok.offset <= i < tok.offset + 256]

        def __call__(self, data: bytes) -> list[int]:
            return [tok.offset + b for b in data]

    wrapper = _Tokens()
    for b in range(256):
        wrapper.tokens[tok.offset + b] = bytes([b])
    return llguidance.TokenizerWrapper(wrapper)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer, over `vocab_size` ids (the model's logits width: ids past the
    tokenizer's own vocabulary are never allowed). About 0.4 s for a 49k vocabulary: build it once."""
    eos = [int(e) for e in eos_token_ids]
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(_byte_tokenizer_wrapper(tokenizer, vocab_size), eos_token=eos)
    raise TypeError(f"structured outputs: no grammar vocabulary for a {type(tokenizer).__name__}")


def _structural_tag_grammar(data: Any, check_schema: Callable[[Any, str], None]) -> str:
    """vLLM's structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`) as a
    llguidance grammar: free text, and wherever a trigger appears, begin + JSON per schema + end. Each schema
    goes through `check_schema(schema, where)` before it is used."""
    if not isinstance(data, dict):
        raise ValueError("must be an object with 'structures' and 'triggers'")
    structures, triggers = data.get("structures"), data.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError("needs non-empty 'structures' and 'triggers' lists")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end", ""), str):
            raise ValueError(f"structures[{i}]: needs 'begin' and 'end' strings and a 'schema'")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structures[{i}]: its begin {s['begin']!r} starts with none of the triggers")
        schema = s.get("schema", ANY_JSON_OBJECT)
        check_schema(schema, f"structures[{i}].schema")
        schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s.get("end", "")))
    return llguidance.StructTag.to_grammar(tags)


def grammar_text(spec: StructuredOutputs, limits: StructuredLimits) -> str:
    """The llguidance grammar of `spec` (validated), or a GrammarError naming its field. Every bound that can
    be checked on the user's text is checked before that text is parsed or converted: its size in bytes, the
    depth and numbers of a JSON text (`paged_jax.bounded_json`), then the expansion of each regex it holds
    (`paged_jax.structured.regex_bounds`); llguidance's own refusals (a JSON syntax error, GBNF it cannot
    convert) name the field too."""
    kind, value = spec.kind, getattr(spec, spec.kind)
    field = f"structured_outputs.{kind}"

    def check_size(size: int) -> None:
        if size > limits.max_grammar_bytes:
            raise GrammarError(field, f"{size} bytes, more than the server's limit of {limits.max_grammar_bytes}")

    def check_regex(regex: str, where: str = "") -> None:
        size = regex_expansion(regex, limits.max_regex_expansion)
        if size > limits.max_regex_expansion:
            raise GrammarError(
                field + where,
                f"the regex {_clip(regex)!r} expands to more than {limits.max_regex_expansion} atoms with its "
                "counted repetitions written out (the server's limit): nested repetitions such as (a{100}){100} "
                "multiply",
            )

    def json_value(value: Any) -> Any:
        """A JSON value given as text (size checked, then parsed with bounds) or as Python objects (walked with
        bounds, never past the size limit)."""
        if isinstance(value, str):
            check_size(len(value.encode("utf-8", "surrogatepass")))
            return load_json(value, field)
        bounded_dumps(value, field, limits.max_grammar_bytes)
        return value

    def check_schema(schema: Any, where: str = "") -> None:
        for place, regex in schema_patterns(schema):
            check_regex(regex, (f".{where}" if where else "") + place)

    try:
        if kind == "json":
            schema = ANY_JSON_OBJECT if value is True else json_value(value)
            if not isinstance(schema, dict):
                raise ValueError("a JSON Schema must be an object")
            check_schema(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        if kind == "regex":
            check_size(len(value.encode("utf-8", "surrogatepass")))
            check_regex(value)
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            check_size(sum(len(c.encode("utf-8", "surrogatepass")) for c in value))
            return llguidance.grammar_from("choice", json.dumps(list(value)))
        if kind == "grammar":
            check_size(len(value.encode("utf-8", "surrogatepass")))
            for regex in lark_regexes(value):
                check_regex(regex)
            for schema in lark_schemas(value):
                check_schema(schema)
            return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted
        return _structural_tag_grammar(json_value(value), check_schema)
    except (ValueError, TypeError) as e:
        if isinstance(e, GrammarError):
            raise
        if isinstance(e, FieldError):
            raise GrammarError(e.field, e.message) from None
        raise GrammarError(field, _first_line(str(e))) from None


class LLGuidanceBackend:
    """`paged_jax.structured.backend.GrammarBackend` with llguidance, for one model's tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: StructuredLimits | None = None,
        num_threads: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or StructuredLimits()
        self._tokenizer, self._eos = tokenizer, tuple(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._parser_limits = llguidance.LLParserLimits(
            max_grammar_size=self.limits.max_grammar_size,
            initial_lexer_fuel=self.limits.initial_lexer_fuel,
            step_lexer_fuel=self.limits.step_lexer_fuel,
            verbose_errors=False,  # an error names the problem, not the grammar and parser state
        )
        self._executor = llguidance.LLExecutor(num_threads)
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.compiled = 0  # grammars compiled (first mask included)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (most engines never see a constrained request)."""
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll

    def matcher(self, spec: StructuredOutputs) -> LLGuidanceMatcher:
        field = f"structured_outputs.{spec.kind}"
        grammar = grammar_text(spec, self.limits)
        tok = self.ll_tokenizer
        job = self._compiler.submit(self._compile, grammar, tok)
        try:
            m = job.result(timeout=self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(
                field, f"did not compile within the server's limit of {self.limits.compile_timeout_s} s"
            ) from None
        if m.is_error():
            raise GrammarError(field, _first_line(m.get_error()))
        return LLGuidanceMatcher(m)

    def _compile(self, grammar: str, tok: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        """The matcher, with its first mask computed: llguidance builds its lexer lazily, so the first fill is
        where a costly grammar pays, and it is paid here, inside the compile deadline, not in a step."""
        m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=self._parser_limits)
        if not m.is_error():
            llguidance.numpy.fill_next_token_bitmask(m, all_allowed(1, self.vocab_size), 0)
        self.compiled += 1
        return m

    def fill(self, rows: Sequence[tuple[LLGuidanceMatcher, int]], bitmask: np.ndarray) -> None:
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m._m, r) for m, r in rows], bitmask)


MAX_ERROR_CHARS = 300  # llguidance quotes the grammar in some errors: a client's 64 KiB are not echoed back


def _first_line(error: str) -> str:
    """llguidance's error without its trailing context (the grammar source, the parser state), clipped."""
    return _clip(error.strip().split("\n<state>")[0].strip(), MAX_ERROR_CHARS)


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."

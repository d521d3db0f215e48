"""Per-request sampling parameters, validated at the edge.

Names and defaults follow vLLM's `SamplingParams` so that users can move over unchanged.
`validate` raises a `FieldError` (a ValueError: "<field>: <what is wrong>") naming the offending field;
each front shows it in its own words (`paged_jax.engine.input_processor`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from paged_jax.errors import FieldError

MAX_LOGPROBS = 20  # top alternatives per token, for `logprobs` and `prompt_logprobs` alike (vLLM's max_logprobs)
MAX_LOGIT_BIAS = 300  # default most `logit_bias` entries per request (the sampler's bias arrays have this width)
LOGIT_BIAS_LIMIT = 100.0  # a bias lies in [-100, 100] (OpenAI's range; +100 forces a token, -100 bans it)
MAX_STOP_TOKEN_IDS = 64  # the sampler's ban list has a fixed width (compiled once), so this many at most
FLOAT32_MAX = 3.4028234663852886e38  # the device computes in float32: larger values become inf there
# Documented limits of the sampling math in float32: above MAX_TEMPERATURE, scores / temperature are so flat
# (3e38: all zero) that top_k=1 and min_p=1 no longer single out the best token; a repetition penalty outside
# [MIN_, MAX_REPETITION_PENALTY] sends a seen token's score to inf or 0 (1e-38: every pick token 0).
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")


def logit_bias_from_json(bias: Any) -> dict[int, float] | Any:
    """A JSON `logit_bias` (OpenAI's: an object of token ids as decimal text -> bias) with integer keys, for the
    fronts whose wire format has only string keys (OpenAI, batch lines); anything but an object is returned as
    it is, for `validate` to refuse. Raises FieldError("logit_bias") for a key that is not an integer's text."""
    if not isinstance(bias, dict):
        return bias
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str):
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise FieldError("logit_bias", f"key {key!r} is not a token id (an integer)")
            key = int(key)
        out[key] = value
    return out


@dataclass(slots=True)
class StructuredOutputs:
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one field is set.

    `json`: a JSON Schema (a dict, or its JSON text), or True for any JSON object; `regex`: the whole output
    matches it; `choice`: the output is one of these strings; `grammar`: a Lark grammar (llguidance's dialect)
    or a GBNF one (llama.cpp's; converted); `structural_tag`: llguidance's tool-call tags, `{"structures":
    [{"begin", "schema", "end"}], "triggers": [...]}` (vLLM's format). The grammar is compiled against the
    model's tokenizer when the request is added (`paged_jax.structured`); a field it refuses is an error for
    that request only, named `structured_outputs.<field>`.
    """

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputs:
        """From `{"json": ...}` and the like; an unknown key is a FieldError naming it."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise FieldError(f"structured_outputs.{unknown[0]}", f"unknown field (known: {', '.join(sorted(names))})")
        return cls(**data)

    @property
    def kind(self) -> str:
        """The one field that is set (validate first)."""
        return next(f.name for f in fields(self) if getattr(self, f.name) is not None)

    def validate(self) -> StructuredOutputs:
        """Types only (the backend compiles the grammar); raises FieldError naming the field."""
        given = [f.name for f in fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise FieldError(
                "structured_outputs", f"set exactly one of json, regex, choice, grammar, structural_tag (got {given})"
            )
        kind = given[0]
        value = getattr(self, kind)
        field_name = f"structured_outputs.{kind}"
        if kind == "json" and not (isinstance(value, (dict, str)) or value is True):
            raise FieldError(field_name, "must be a JSON Schema (an object or its text) or true")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise FieldError(field_name, "must be a non-empty string")
        if kind == "choice" and (
            not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value)
        ):
            raise FieldError(field_name, "must be a non-empty list of non-empty strings")
        if kind == "structural_tag" and not isinstance(value, (dict, str)):
            raise FieldError(field_name, "must be an object (or its JSON text)")
        return self


def _id_range(vocab_size: int | None) -> str:
    """Where token ids lie, for a message: the model's range, or (validated before a model is known, as the
    batch job's lines are) only that they are not negative."""
    return f" in [0, {vocab_size})" if vocab_size else " (a non-negative integer)"


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy (below 1e-5 sampling is greedy too); at most `MAX_TEMPERATURE`.
    `repetition_penalty` lies in [`MIN_REPETITION_PENALTY`, `MAX_REPETITION_PENALTY`] (1 = off).
    `top_k` 0 (or -1) and `top_p` 1 disable those filters.
    `seed` makes a request's samples reproducible whatever else shares the batch.
    `logprobs` asks for that many top alternatives per generated token (plus the chosen one).
    `prompt_logprobs` (vLLM's): the logprob of every prompt token given the tokens before it (None for the
    first), plus that many top alternatives at each position; the request then computes its whole prompt (its
    prefix-cache hits are not read, as in vLLM: cached tokens have no logits).
    `max_tokens=0` computes the prompt and generates nothing (prompt scoring with `prompt_logprobs`).
    `logit_bias` (vLLM's and OpenAI's): token id -> a number in [-100, 100] added to that token's logit before
    penalties, filters and sampling (greedy rows too); logprobs stay those of the model's own distribution.
    `detokenize=False` returns token ids without text (no per-token detokenization on the host).
    `max_reasoning_tokens`: on a model whose chat template thinks (`paged_jax.tokenization.reasoning`), the
    thought's budget: past it the engine writes the end tag and the answer continues (`structured.thought`);
    `structured_outputs` on such a model constrain the answer only.
    `speculate=False` opts this request out of speculative decoding (an engine with a `speculative_config`
    decodes it one token per step; its tokens are the same either way, only its speed differs).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text
    spaces_between_special_tokens: bool = True  # False: added tokens kept as written, runs decoded alone
    detokenize: bool = True  # False: token ids only, no text (as vLLM's); stop strings then cannot be matched
    speculate: bool = True  # False: no speculative drafts for this request (`paged_jax.spec_decode`)
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, choice or grammar to follow
    max_reasoning_tokens: int | None = None  # a thinking model's thought: past this many tokens it is closed

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (list, tuple)):  # anything else (a dict, a set) is refused by validate
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(
        self, vocab_size: int | None = None, max_n: int = 64, max_logit_bias: int = MAX_LOGIT_BIAS
    ) -> SamplingParams:
        """Check every field; return self so calls can chain. Raises FieldError naming the field."""

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FieldError(name, f"must be a finite number, got {value!r}")
            if abs(value) > FLOAT32_MAX:  # checked in the dtype it is used in
                raise FieldError(name, f"{value!r} is not finite in float32 (the device's dtype)")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise FieldError(name, f"must be an integer, got {value!r}")
            return value

        if not 1 <= integer("n") <= max_n:
            raise FieldError("n", f"must be in [1, {max_n}], got {self.n}")
        if not 0 <= number("temperature") <= MAX_TEMPERATURE:
            raise FieldError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if integer("top_k") < 0:
            raise FieldError("top_k", f"must be >= 0 (0 or -1 disables it), got {self.top_k}")
        if not 0.0 < number("top_p") <= 1.0:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= number("min_p") <= 1.0:
            raise FieldError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= number("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise FieldError(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )
        if not -2.0 <= number("presence_penalty") <= 2.0:
            raise FieldError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= number("frequency_penalty") <= 2.0:
            raise FieldError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise FieldError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if integer("max_tokens") < 0:
            raise FieldError("max_tokens", f"must be >= 0 (0: the prompt only), got {self.max_tokens}")
        if not 0 <= integer("min_tokens") <= self.max_tokens:
            raise FieldError("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if not isinstance(self.stop, list):
            raise FieldError("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
        if not isinstance(self.stop_token_ids, list):
            raise FieldError("stop_token_ids", f"must be a list of token ids, got {type(self.stop_token_ids).__name__}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"every stop string must be a non-empty string, got {s!r}")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise FieldError("stop", f"not valid Unicode (a lone surrogate at character {e.start})") from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids", f"{len(self.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                raise FieldError("stop_token_ids", f"{t!r:.40} is not a token id{_id_range(vocab_size)}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"must be a boolean, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise FieldError("detokenize", "stop strings are matched on the text; detokenize=False cannot have them")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            if value is not None and bad:
                raise FieldError(name, f"must be in [0, {MAX_LOGPROBS}], got {value!r}")
        self._validate_logit_bias(vocab_size, max_logit_bias)
        budget = self.max_reasoning_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise FieldError("max_reasoning_tokens", f"must be an integer >= 0, got {budget!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise FieldError("structured_outputs", "must be a StructuredOutputs (or a dict of its fields)")
            self.structured_outputs.validate()
        return self

    def _validate_logit_bias(self, vocab_size: int | None, max_entries: int) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise FieldError("logit_bias", f"must be a map of token id to bias, got {type(bias).__name__}")
        if len(bias) > max_entries:
            raise FieldError("logit_bias", f"{len(bias)} entries, more than {max_entries}")
        for t, v in bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                raise FieldError("logit_bias", f"{t!r:.40} is not a token id{_id_range(vocab_size)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise FieldError("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {v!r}")

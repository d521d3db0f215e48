"""`SpeculativeConfig`: how an engine speculates (vLLM's `speculative_config` names), validated with errors that
name the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from paged_jax.bounded_json import load_json
from paged_jax.config import WEIGHT_QUANTIZATIONS

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence per step: each is a sample row and a KV slot of the verify step
MAX_PROMPT_LOOKUP = 32  # n-gram lengths: each step's lookup on the engine thread grows with it
MAX_COUNT = 1_000_000  # the step and token counters of the pause rules (probe_tokens, pause_tokens, ...)
MAX_BATCH_SIZE = 2**20  # disable_by_batch_size
MAX_DRAFT_PAGES = 2**24  # draft_num_pages
MAX_MODEL_CHARS = 4096  # model (a path or a Hugging Face id)
# field -> (lowest, highest) of the integer fields
INT_BOUNDS = {
    "prompt_lookup_min": (1, MAX_PROMPT_LOOKUP),
    "prompt_lookup_max": (1, MAX_PROMPT_LOOKUP),
    "probe_tokens": (1, MAX_COUNT),
    "max_misses": (1, MAX_COUNT),
    "pause_tokens": (1, MAX_COUNT),
    "cost_probe_steps": (1, MAX_COUNT),
    "cost_pause_steps": (1, MAX_COUNT),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup over the sequence's own tokens) or "draft_model" (a smaller model with the
    target's vocabulary: `model`, loaded like the target, optionally `quantization`, e.g. "w8a8" of the target
    itself). `num_speculative_tokens`: the most drafts per sequence per step (k).

    n-gram: the longest suffix of the sequence of `prompt_lookup_min`..`prompt_lookup_max` tokens that occurred
    earlier proposes the tokens that followed its latest occurrence.

    `adaptive_k`: each sequence's draft length adapts to its own recent acceptance (`paged_jax.spec_decode.decoder`):
    it starts at k, doubles (up to k) after a verify that kept every draft and drops to one more than the drafts
    kept after one that rejected some, so a sequence copying a long span drafts k, one that just diverged drafts
    little. k is then the most a sequence drafts.

    Per sequence, speculation pauses while it does not pay (`paged_jax.spec_decode.decoder`): after `probe_tokens`
    proposed drafts with an acceptance rate below `min_acceptance_rate` it pauses for `pause_tokens` output
    tokens, doubling up to 16x for a sequence that keeps failing; after `max_misses` steps in a row without a
    proposal it pauses for `pause_tokens` (not doubled: a step without a draft scores nothing it would not score
    anyway, its only cost is the lost lookahead, and a reply that copies again later must find its copy).
    `disable_by_batch_size` (vLLM's): no sequence speculates while more than this many run (a large batch is
    compute-bound, where scoring k rejected drafts costs as much as k sequences' tokens); None: no limit.

    Per batch, `pause_by_cost` (`paged_jax.spec_decode.cost`): the engine measures decode tokens per second with and
    without speculation for each batch size; every `cost_probe_steps` speculating steps it compares them (first
    measuring plain decoding for that many steps when it has no recent figure) and, where speculating was
    slower by more than `cost_margin` (a fraction of the plain rate: timing noise alone must not pause it),
    decodes plainly for `cost_pause_steps` steps (doubling, up to 16x, while it keeps losing; longer where it
    lost so badly that the next probe would cost more than `cost_margin` of the time) before it probes again.
    A request opts out with `SamplingParams.speculate=False`.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    quantization: str | None = None
    draft_num_pages: int | None = None  # the draft model's KV pages (None: as many as the target's)
    min_acceptance_rate: float = 0.3
    probe_tokens: int = 12
    max_misses: int = 8
    pause_tokens: int = 8
    adaptive_k: bool = True
    disable_by_batch_size: int | None = None
    pause_by_cost: bool = True
    cost_probe_steps: int = 8
    cost_pause_steps: int = 32
    cost_margin: float = 0.05

    @classmethod
    def from_dict(cls, value: Mapping | str | SpeculativeConfig) -> SpeculativeConfig:
        """From a mapping or its JSON text (the CLI's `--speculative-config`); unknown keys are refused."""
        if isinstance(value, SpeculativeConfig):
            value.validate()
            return value
        if isinstance(value, str):
            value = load_json(value, "speculative_config")  # FieldError naming the place (depth, huge numbers)
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: expected a mapping, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown field (known: {', '.join(sorted(names))})")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        """Every field's type and bounds; ValueError `speculative_config.<field>: ...` (one line)."""

        def fail(name: str, why: str) -> None:
            raise ValueError(f"speculative_config.{name}: {why}, got {getattr(self, name)!r:.80}")

        if not isinstance(self.method, str) or self.method not in METHODS:
            fail("method", f"must be one of {METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail("num_speculative_tokens", f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("pause_by_cost", "adaptive_k"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        for name, (low, high) in INT_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                fail(name, f"must be an int in [{low}, {high}]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail("prompt_lookup_min", f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            fail("min_acceptance_rate", "must be in [0, 1]")
        margin = self.cost_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            fail("cost_margin", "must be in [0, 1)")
        if self.model is not None and (not isinstance(self.model, str) or not 0 < len(self.model) <= MAX_MODEL_CHARS):
            fail("model", f"must be a path or model id of 1 to {MAX_MODEL_CHARS} characters")
        if self.method == "draft_model":
            if not self.model:
                fail("model", 'is required with method "draft_model"')
        elif self.model is not None:
            fail("model", f'is only for method "draft_model", not {self.method!r}')
        if self.quantization is not None and (
            not isinstance(self.quantization, str) or self.quantization not in WEIGHT_QUANTIZATIONS
        ):
            fail("quantization", f"must be one of {WEIGHT_QUANTIZATIONS}")
        if self.disable_by_batch_size is not None and (
            isinstance(self.disable_by_batch_size, bool)
            or not isinstance(self.disable_by_batch_size, int)
            or not 1 <= self.disable_by_batch_size <= MAX_BATCH_SIZE
        ):
            fail("disable_by_batch_size", f"must be an int in [1, {MAX_BATCH_SIZE}] or null")
        pages = self.draft_num_pages
        if pages is not None and (
            isinstance(pages, bool) or not isinstance(pages, int) or not 2 <= pages <= MAX_DRAFT_PAGES
        ):
            fail("draft_num_pages", f"must be an int in [2, {MAX_DRAFT_PAGES}] or null")

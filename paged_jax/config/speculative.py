"""`SpeculativeConfig`: how an engine speculates (vLLM's `speculative_config` names), validated with errors that
name the field."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from paged_jax.config import WEIGHT_QUANTIZATIONS

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per sequence per step: each is a sample row and a KV slot of the verify step


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
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
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
        def fail(name: str, why: str) -> None:
            raise ValueError(f"speculative_config.{name}: {why}, got {getattr(self, name)!r}")

        if self.method not in METHODS:
            fail("method", f"must be one of {METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail("num_speculative_tokens", f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        for name in ("pause_by_cost", "adaptive_k"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        ints = ("prompt_lookup_min", "prompt_lookup_max", "probe_tokens", "max_misses", "pause_tokens")
        for name in (*ints, "cost_probe_steps", "cost_pause_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "must be an int >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail("prompt_lookup_min", f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.min_acceptance_rate, (int, float)) or not 0 <= self.min_acceptance_rate <= 1:
            fail("min_acceptance_rate", "must be in [0, 1]")
        margin = self.cost_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            fail("cost_margin", "must be in [0, 1)")
        if self.method == "draft_model":
            if not self.model:
                fail("model", 'is required with method "draft_model"')
        elif self.model is not None:
            fail("model", f'is only for method "draft_model", not {self.method!r}')
        if self.quantization is not None and self.quantization not in WEIGHT_QUANTIZATIONS:
            fail("quantization", f"must be one of {WEIGHT_QUANTIZATIONS}")
        if self.disable_by_batch_size is not None and (
            isinstance(self.disable_by_batch_size, bool)
            or not isinstance(self.disable_by_batch_size, int)
            or self.disable_by_batch_size < 1
        ):
            fail("disable_by_batch_size", "must be an int >= 1 or null")
        if self.draft_num_pages is not None and (not isinstance(self.draft_num_pages, int) or self.draft_num_pages < 2):
            fail("draft_num_pages", "must be an int >= 2")

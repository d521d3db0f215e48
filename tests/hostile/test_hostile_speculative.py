"""`--speculative-config` values that parse but are wrong (issue 41): every field is bounded, and each refusal is a
one-line ValueError naming `speculative_config.<field>` (the CLI shows it as `--speculative-config: <field>: ...`),
never a traceback; `prompt_lookup_max` has an upper bound (the n-gram lookup runs on the engine thread)."""

from __future__ import annotations

import json

import pytest

from paged_jax.config.engine import EngineConfig
from paged_jax.config.speculative import MAX_PROMPT_LOOKUP, SpeculativeConfig

BAD = {  # field: a value JSON can hold that the field refuses
    "method": ["ngram"],
    "num_speculative_tokens": 17,
    "prompt_lookup_max": 100_000,
    "prompt_lookup_min": 0,
    "probe_tokens": 10**12,
    "max_misses": "8",
    "pause_tokens": 2.5,
    "cost_probe_steps": -1,
    "cost_pause_steps": True,
    "min_acceptance_rate": True,
    "cost_margin": 1.5,
    "model": 5,
    "quantization": {"w8a8": 1},
    "disable_by_batch_size": 10**9,
    "draft_num_pages": True,
    "adaptive_k": "yes",
    "pause_by_cost": 1,
}


@pytest.mark.parametrize("field", BAD)
def test_every_field_is_bounded_with_a_one_line_error(field):
    text = json.dumps({field: BAD[field]})
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=text)
    message = str(e.value)
    assert message.startswith(f"speculative_config.{field}: ") and "\n" not in message, message
    assert type(e.value) is ValueError


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"probe_tokens": ' + "7" * 5000 + "}", "speculative_config.probe_tokens"),
        ("[" * 5000 + "]" * 5000, "speculative_config"),
        ('{"cost_margin": NaN}', "speculative_config.cost_margin"),
    ],
)
def test_json_text_is_read_with_bounds(text, where):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(text)
    assert str(e.value).startswith(f"{where}: ") and "Exceeds the limit" not in str(e.value)


def test_bounds_keep_the_useful_range():
    config = SpeculativeConfig.from_dict({"prompt_lookup_min": 1, "prompt_lookup_max": MAX_PROMPT_LOOKUP})
    assert config.prompt_lookup_max == MAX_PROMPT_LOOKUP
    assert SpeculativeConfig.from_dict('{"method": "draft_model", "model": "tiny", "draft_num_pages": 64}').model

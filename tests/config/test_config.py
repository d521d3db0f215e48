"""Config validation: every bad value is a ConfigError naming the field; HF config mapping."""

from __future__ import annotations

import json

import pytest

from paged_jax.config import ConfigError, ModelConfig, available_configs, load_model_config
from paged_jax.config.hf import from_hf_config


def _write(tmp_path, **changes):
    data = {k: v for k, v in load_model_config("tiny").to_dict().items() if k != "name"}
    data.update(changes)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"head_dim": 33}, "head_dim"),
        ({"hidden_size": 250, "head_dim": 0}, "num_heads"),
        ({"intermediate_size": -4}, "intermediate_size"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"dtype": "float64"}, "dtype"),
        ({"eos_token_ids": [999]}, "eos_token_ids"),
        (
            {"rope_scaling": {"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
            "rope_scaling.high_freq_factor",
        ),
        ({"rope_scaling": {"factor": 8.0, "beta": 1}}, "rope_scaling.beta"),
        ({"num_experts": 8}, "num_experts"),
    ],
)
def test_bad_values_name_the_field(tmp_path, changes, field):
    with pytest.raises(ConfigError, match=rf"^{field}"):
        load_model_config(_write(tmp_path, **changes))


def test_every_shipped_config_loads():
    names = available_configs()
    assert {"tiny", "llama-3.2-1b", "llama-3.1-8b", "llama-2-7b", "mistral-7b", "qwen2.5-0.5b"} <= set(names)
    for name in names:
        config = load_model_config(name)
        assert config.name == name and config.num_heads % config.num_kv_heads == 0
    assert load_model_config("llama-3.2-1b").num_params() == 1_235_814_400


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="^model: unknown config"):
        load_model_config("no-such-model")


def test_hf_config_mapping_old_and_new_rope_fields():
    base = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=[2, 3],
    )
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    old = from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {**rope, "rope_type": "llama3"}})
    new = from_hf_config({**base, "rope_parameters": {**rope, "rope_type": "llama3", "rope_theta": 5e5}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling.factor == 8.0
    assert old.eos_token_ids == (2, 3) and old.head_dim == 16
    plain = from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4
    with pytest.raises(ConfigError, match="^rope_scaling.rope_type"):
        from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="^mlp_bias"):
        from_hf_config({**base, "mlp_bias": True})
    with pytest.raises(ConfigError, match="^architectures"):
        from_hf_config({**base, "architectures": ["GPT2LMHeadModel"]})


def test_replace_revalidates():
    with pytest.raises(ConfigError, match="^num_kv_heads"):
        ModelConfig().replace(num_kv_heads=5)

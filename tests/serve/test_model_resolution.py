"""`--model` resolution (paged_jax.model.loader.resolve): a path, a named real model, a Hugging Face id from the
local hub cache, an architecture config, or one line saying which it is not, with close names real models
first."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_jax.config import ConfigError, available_configs
from paged_jax.model.loader.named import NAMED_MODELS
from paged_jax.model.loader.resolve import cached_hub_models, hub_cache_dir, hub_snapshot, resolve_model
from serve.main import main

HF_GQA = Path(__file__).resolve().parents[1] / "data" / "hf_gqa"


def refused(spec: str) -> str:
    with pytest.raises(ConfigError) as e:
        resolve_model(spec)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_missing_path_says_so(tmp_path):
    (tmp_path / "SmolLM2-135M").mkdir()
    assert refused(str(tmp_path / "nope")) == f"model: {tmp_path / 'nope'}: no such file or directory"
    assert refused(str(tmp_path / "SmolLM2-135m")) == (
        f"model: {tmp_path / 'SmolLM2-135m'}: no such file or directory (did you mean '{tmp_path / 'SmolLM2-135M'}'?)"
    )
    assert refused("/no/such/dir/model") == "model: /no/such/dir/model: no such file or directory " + (
        "(/no/such/dir does not exist either)"
    )
    assert refused("./weights.gguf") == "model: ./weights.gguf: no such file or directory"


def test_a_typo_suggests_the_real_model_before_the_random_config(hub_cache):
    message = refused("smollm2-135m-instuct")
    assert message.startswith(
        "model: unknown model 'smollm2-135m-instuct' (did you mean 'smollm2-135m-instruct' or "
        "'smollm2-135m' (random weights)?); real models: smollm2-135m-instruct; random-weight configs: "
    )
    assert ", ".join(available_configs()) in message
    assert refused("zzzz").startswith("model: unknown model 'zzzz'; real models: ")
    hub_cache("HuggingFaceTB/SmolLM2-135M-Instruct")  # a cached id is a real model too
    assert "(did you mean 'HuggingFaceTB/SmolLM2-135M-Instruct'?)" in refused("HuggingFaceTB/SmolLM2-135M-Instruc")


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache, tmp_path, monkeypatch):
    snapshot = hub_cache("acme/gqa-tiny")
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    source = resolve_model("acme/gqa-tiny")
    assert (source.kind, source.path, source.name, source.random_weights) == ("hub", snapshot, "acme/gqa-tiny", False)
    assert cached_hub_models() == ["acme/gqa-tiny"]
    # refs/main picks the revision among several snapshots; HF_HUB_CACHE wins over HF_HOME
    other = hub_cache("acme/gqa-tiny", cache=tmp_path / "hub2", revision="f" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub2"))
    assert hub_snapshot("acme/gqa-tiny") == other


def test_an_uncached_hub_id_says_how_to_get_it(hub_cache, tmp_path):
    assert refused("acme/absent") == (
        f"model: 'acme/absent' is neither a local directory nor in the Hugging Face cache "
        f"({tmp_path / 'hf-home' / 'hub'}); paged-jax does not download: fetch it with "
        "`huggingface-cli download acme/absent`, then pass the id or its directory"
    )


def test_names_and_configs(tmp_path):
    tiny = resolve_model("tiny")
    assert (tiny.kind, tiny.path, tiny.random_weights) == ("config", None, True)
    assert resolve_model(HF_GQA).kind == "path" and not resolve_model(HF_GQA).random_weights
    config_json = tmp_path / "c.json"
    config_json.write_text("{}")
    assert resolve_model(config_json).random_weights
    assert set(NAMED_MODELS) == {"smollm2-135m-instruct"}


def test_info_loads_a_hub_id_under_its_name(hub_cache, capsys):
    hub_cache("acme/gqa-tiny")
    assert main(["info", "--model", "acme/gqa-tiny"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "model: acme/gqa-tiny (float32)"
    assert "layers=2 hidden=64 heads=8 kv_heads=2" in out


def test_info_on_a_typo_is_one_line(capsys):
    assert main(["info", "--model", "tinyy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paged-jax info: error: model: unknown model 'tinyy' (did you mean 'tiny' (random weights)?)")
    assert err.count("\n") == 1

"""HF import errors name the tensor; orbax round trip; load_model sources; partition specs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from paged_jax.config import load_model_config
from paged_jax.engine.load import load_model
from paged_jax.model.init import init_params
from paged_jax.model.loader.checkpoint import load_checkpoint, save_checkpoint
from paged_jax.model.loader.fuse import fuse_params, unfuse_params
from paged_jax.model.loader.hf import WeightsError, load_hf_params
from paged_jax.model.partition import param_partition_specs

GQA = Path(__file__).parents[1] / "data" / "hf_gqa"


def _broken_copy(tmp_path: Path, edit) -> Path:
    directory = tmp_path / "broken"
    directory.mkdir()
    shutil.copy(GQA / "config.json", directory / "config.json")
    tensors = load_file(str(GQA / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _load(directory: Path):
    return load_hf_params(directory, load_model_config(directory))


def test_missing_tensor_is_named(tmp_path):
    d = _broken_copy(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight: missing"):
        _load(d)


def test_extra_tensor_is_named(tmp_path):
    d = _broken_copy(tmp_path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, "f4")}))
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias: unexpected"):
        _load(d)


def test_wrong_shape_is_named(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # [16, 64] stored transposed
    d = _broken_copy(tmp_path, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
    pattern = rf"{name}: shape \(64, 16\) does not fit the config \(expected \(16, 64\)\)"
    with pytest.raises(WeightsError, match=pattern):
        _load(d)


def test_bad_dtype_is_named(tmp_path):
    name = "model.norm.weight"
    d = _broken_copy(tmp_path, lambda t: t.update({name: t[name].astype(np.int32)}))
    with pytest.raises(WeightsError, match=rf"{name}: dtype int32 cannot be loaded"):
        _load(d)


def test_pickle_checkpoints_are_not_read(tmp_path):
    shutil.copy(GQA / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        _load(tmp_path)


def test_bfloat16_import_and_dtype_override(tmp_path):
    config, params32, _ = load_model(GQA, dtype="float32")
    config16, params16, tok = load_model(GQA, dtype="bfloat16")
    assert config16.dtype == "bfloat16" and tok.vocab_size == 320
    for a, b in zip(jax.tree_util.tree_leaves(params32), jax.tree_util.tree_leaves(params16), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_orbax_round_trip(tmp_path, tiny_config):
    config = tiny_config.replace(tie_word_embeddings=True, attention_bias=True, dtype="bfloat16")
    params = init_params(config, seed=5)
    save_checkpoint(tmp_path / "ckpt", config, params)
    restored_config, restored = load_checkpoint(tmp_path / "ckpt")
    assert restored_config == config
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    config2, params2, tokenizer = load_model(str(tmp_path / "ckpt"), dtype="float32")
    assert config2.dtype == "float32" and params2["params"]["norm"]["weight"].dtype == jnp.float32
    assert tokenizer.encode("a", add_special_tokens=False) == [3 + 97]


def test_checkpoint_written_before_the_fusion_loads_fused_and_exact(tmp_path, tiny_config):
    config = tiny_config.replace(attention_bias=True)
    params = init_params(config, seed=6)
    save_checkpoint(tmp_path / "old", config, unfuse_params(params))  # one kernel per projection
    _, restored = load_checkpoint(tmp_path / "old")
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_layout_groups_queries_with_their_kv_head(tiny_config):
    """qkv_proj[:, j] holds the query heads that read KV head j, then K and V of head j (HF's repeat_kv
    pairing), so a TP split of axis 1 keeps whole groups; fuse/unfuse are exact inverses."""
    config = tiny_config.replace(attention_bias=True)
    fused = init_params(config, seed=7)
    flat = unfuse_params(fused)
    attn, g = flat["params"]["layers_1"]["self_attn"], config.num_heads // config.num_kv_heads
    qkv = np.asarray(fused["params"]["layers_1"]["self_attn"]["qkv_proj"])
    for j in range(config.num_kv_heads):
        np.testing.assert_array_equal(qkv[:, j, :g], np.asarray(attn["q_proj"])[:, j * g : (j + 1) * g])
        np.testing.assert_array_equal(qkv[:, j, g], np.asarray(attn["k_proj"])[:, j])
        np.testing.assert_array_equal(qkv[:, j, g + 1], np.asarray(attn["v_proj"])[:, j])
    gate_up = np.asarray(fused["params"]["layers_1"]["mlp"]["gate_up_proj"])
    np.testing.assert_array_equal(gate_up[:, 0], np.asarray(flat["params"]["layers_1"]["mlp"]["gate_proj"]))
    np.testing.assert_array_equal(gate_up[:, 1], np.asarray(flat["params"]["layers_1"]["mlp"]["up_proj"]))
    again = fuse_params(config, flat)
    for a, b in zip(jax.tree_util.tree_leaves(fused), jax.tree_util.tree_leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_partition_specs_match_params(tiny_config):
    config = tiny_config.replace(attention_bias=True)
    params = init_params(config, 0)
    specs = param_partition_specs(config, params)
    assert jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree_util.tree_structure(
        params
    )
    layer = specs["params"]["layers_0"]
    assert layer["self_attn"]["qkv_proj"] == P(None, "tp", None, None)  # whole KV-head groups per shard
    assert layer["self_attn"]["qkv_bias"] == P("tp", None, None)
    assert layer["mlp"]["gate_up_proj"] == P(None, None, "tp")
    assert layer["self_attn"]["o_proj"] == P("tp", None, None)
    assert layer["mlp"]["down_proj"] == P("tp", None) and layer["input_layernorm"]["weight"] == P()
    assert specs["params"]["embed_tokens"]["embedding"] == P("tp", None)
    assert specs["params"]["lm_head"] == P(None, "tp")
    for spec, leaf in zip(
        jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        jax.tree_util.tree_leaves(params),
        strict=True,
    ):
        assert len(spec) <= leaf.ndim


def test_a_config_too_big_for_the_machine_is_refused_naming_the_field(tmp_path):
    """Issue 14.11: `num_hidden_layers: 1e9` allocated for minutes. The parameter bytes are known from the config
    alone, so it is refused at once, naming the field that makes it too big."""
    import json

    from paged_jax.config import ConfigError
    from paged_jax.model.loader.budget import check_fits

    d = tmp_path / "huge"
    shutil.copytree(GQA, d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": 1e9}))
    with pytest.raises(ConfigError, match=r"^num_layers \(num_hidden_layers in config.json\): 1000000000 makes"):
        load_model(str(d))  # before anything is allocated (it used to run for minutes)
    tiny = load_model_config("tiny")
    with pytest.raises(ConfigError, match="^vocab_size:"):
        check_fits(tiny.replace(vocab_size=10**12))
    with pytest.raises(ConfigError, match="^hidden_size:"):
        check_fits(tiny, budget_bytes=1000)  # hidden_size is in every term
    check_fits(tiny)


def test_shard_paths_must_stay_inside_the_model_directory(tmp_path):
    """Issue 14.11: a shard index entry `../../../../etc/hostname` was opened."""
    import json

    d = tmp_path / "escape"
    shutil.copytree(GQA, d)
    names = list(load_file(str(GQA / "model.safetensors")))
    weight_map = {n: "model.safetensors" for n in names} | {names[0]: "../../../../../../../../etc/hostname"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match=rf"^{re.escape(names[0])}: its shard .* is not a file inside"):
        _load(d)


def test_names_and_shapes_are_checked_before_any_tensor_is_read(tmp_path):
    """Issue 14.11: every tensor was read before its name and shape were checked, so an unexpected 512 MiB tensor
    cost 2 GB of peak memory before the error. The headers are checked first; nothing is read."""
    import tracemalloc

    big = np.zeros(8 * 2**20, np.float32)  # 32 MiB, sorted first ("a..."), unexpected
    d = _broken_copy(tmp_path, lambda t: t.update({"a.unexpected": big}))
    tracemalloc.start()
    try:
        with pytest.raises(WeightsError, match=r"^a\.unexpected: unexpected tensor"):
            _load(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB read before the error"

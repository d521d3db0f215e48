"""Import a GGUF checkpoint (llama.cpp's format): its `ModelConfig` and its parameters.

The architecture's metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...) becomes a
`ModelConfig`; each tensor is renamed to its Hugging Face name, dequantized to float32 (gguf-py's
reference dequantizer, see `gguf_file`), un-permuted where llama.cpp permuted it, and handed to
`hf_import.params_from_hf_tensors`, which shape-checks it and lays it out as ours. Tensors are
read one at a time through the memory map.

llama.cpp's converter reorders the rows of a Llama `attn_q`/`attn_k` weight, head by head, from
HF's rotate-half RoPE layout (first half of the head dim, then second half) to interleaved pairs;
`unpermute_qk` undoes that, exactly as transformers' GGUF loader does. Qwen2 files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.model.init import Params
from paged_jax.model.loader.gguf_file import GGUFError, GGUFFile
from paged_jax.model.loader.hf import params_from_hf_tensors

# GGUF architectures we can run -> whether llama.cpp permuted their Q/K rows for RoPE.
SUPPORTED_ARCHITECTURES = {"llama": True, "qwen2": False}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row permutation of a Q or K weight `[num_heads * head_dim, in]` (or bias).

    llama.cpp stored row `(h, i, j)` of shape `[num_heads, head_dim / 2, 2]` from HF's row `(h, j, i)`.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(gguf: GGUFFile, name: str | None = None, dtype: str = "float32") -> ModelConfig:
    """A `ModelConfig` from a GGUF's architecture metadata. Raises `GGUFError` for what we cannot run."""
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"general.architecture: {arch!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )

    def key(suffix: str, default: Any = ...) -> Any:
        return gguf.get(f"{arch}.{suffix}", default)

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFError(f"{arch}.rope.scaling.type: {scaling!r} RoPE scaling is not supported")
    names = set(gguf.tensor_names())
    if "rope_freqs.weight" in names:
        raise GGUFError("rope_freqs.weight: per-frequency RoPE factors (Llama-3.1 style) are not supported yet")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rot = int(key("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{arch}.rope.dimension_count: partial rotary ({rot} of {head_dim}) is not supported")
    tokens = gguf.get("tokenizer.ggml.tokens", None)
    vocab = key("vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise GGUFError(f"{arch}.vocab_size: missing, and the file has no tokenizer.ggml.tokens to count")
    eos: list[int] = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = gguf.get(k, None)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    bos = gguf.get("tokenizer.ggml.bos_token_id", None)
    return ModelConfig(
        name=name or gguf.path.stem,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        dtype=dtype,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos),
    )


def iter_hf_tensors(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 `[out, in]` array) for each tensor of the file, dequantized one at a time."""
    permuted = SUPPORTED_ARCHITECTURES.get(gguf.architecture, False)
    for tensor in gguf.tensors():
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None:
            raise GGUFError(
                f"{tensor.name}: unexpected tensor in {gguf.path.name} (no place in a {gguf.architecture} model)"
            )
        values = tensor.dequantize()
        if permuted and ".q_proj." in hf_name:
            values = unpermute_qk(values, config.num_heads)
        elif permuted and ".k_proj." in hf_name:
            values = unpermute_qk(values, config.num_kv_heads)
        yield hf_name, values


def load_gguf(
    path: str | Path, dtype: str | None = None, name: str | None = None
) -> tuple[ModelConfig, Params, GGUFFile]:
    """(config, params, the open file) for a GGUF checkpoint; params dequantized to `dtype` (default float32)."""
    gguf = GGUFFile(path)
    config = config_from_gguf(gguf, name=name, dtype=dtype or "float32")
    params = params_from_hf_tensors(iter_hf_tensors(gguf, config), config, str(gguf.path))
    return config, params, gguf


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "config_from_gguf",
    "hf_tensor_name",
    "iter_hf_tensors",
    "load_gguf",
    "unpermute_qk",
]

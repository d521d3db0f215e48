"""Hugging Face `config.json` -> `ModelConfig`: the one place that knows transformers' field names.

Dispatched on the config's `model_type` (else its `architectures`); an unsupported type, or a feature of a
supported one that we do not implement, is a `ConfigError` naming the field.
"""

from __future__ import annotations

from typing import Any

from paged_jax.config.model import DTYPES, ROPE_TYPES, ConfigError, ModelConfig, RopeScaling

# HF `model_type` -> ours. Llama, Mistral and Qwen2 are one family here ("llama": Qwen2 adds q/k/v biases,
# Mistral a sliding window). The multimodal "gemma3" (vision tower, `text_config`) is refused with a hint.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
}


HF_TEXT_ARCHITECTURES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


def _hf_model_type(hf: dict[str, Any]) -> str:
    """The HF model type of a config.json (its `model_type`, else from `architectures`); ConfigError if unsupported."""
    arch = (hf.get("architectures") or [None])[0]
    kind = hf.get("model_type") or HF_ARCHITECTURES.get(arch) or ("llama" if arch is None else None)
    if kind in ("qwen3_5", "qwen3_5_moe"):
        raise ConfigError(
            f"model_type: {kind!r} is the multimodal Qwen3.5 (vision tower, text_config); only its text decoder "
            f"('{kind}_text', {HF_TEXT_ARCHITECTURES[kind]}) is supported"
        )
    if kind == "gemma3":
        raise ConfigError(
            "model_type: 'gemma3' is the multimodal Gemma 3 (vision tower, text_config); only its "
            "text decoder ('gemma3_text', Gemma3ForCausalLM) is supported"
        )
    if kind not in HF_MODEL_TYPES:
        field, shown = ("model_type", kind) if kind is not None else ("architectures", arch)
        raise ConfigError(
            f"{field}: {shown!r} is not a supported model type (supported: {', '.join(sorted(HF_MODEL_TYPES))})"
        )
    return kind


def _hf_rope(rp: dict[str, Any] | None, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from one transformers rope dict (`rope_parameters` or old `rope_scaling`)."""
    rp = rp or {}
    theta = float(rp.get("rope_theta", default_theta))
    kind = rp.get("rope_type", rp.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(factor=float(rp["factor"]), rope_type="linear")
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type: {kind!r} is not supported (only {ROPE_TYPES})")
    return theta, RopeScaling(
        factor=float(rp["factor"]),
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 8192)),
    )


def _hf_window_pattern(hf: dict[str, Any], default: int) -> int:
    """Gemma's `sliding_window_pattern` N (layer i global iff (i + 1) % N == 0), from `layer_types` when given."""
    types = hf.get("layer_types")
    if not types:
        value = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default
        return _num(int, {"sliding_window_pattern": value}, "sliding_window_pattern")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    n = full[0] + 1 if full else len(types) + 1
    expected = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(types))]
    if list(types) != expected:
        raise ConfigError(f"layer_types: only a periodic pattern (every N-th layer global) is supported, got {types}")
    return n


def _hf_family_fields(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """The ModelConfig fields that depend on the HF model type (window, caps, experts, RoPE bases)."""
    rope_params = hf.get("rope_parameters") or {}
    theta, scaling = _hf_rope(hf.get("rope_scaling") or rope_params, hf.get("rope_theta", 10000.0))
    if "rope_theta" in hf:
        theta = _num(float, hf, "rope_theta")
    out: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling, model_type=HF_MODEL_TYPES[kind])
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if kind in ("gemma2", "gemma3_text"):
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation: Gemma needs 'gelu_pytorch_tanh' (GeGLU), got {act!r}")
        if hf.get("attention_bias"):
            raise ConfigError("attention_bias: Gemma with attention biases is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention: only causal Gemma is supported")
        out.update(
            sliding_window=hf.get("sliding_window"),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            sliding_window_pattern=_hf_window_pattern(hf, 2 if kind == "gemma2" else 6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            attention_bias=False,
        )
        if kind == "gemma3_text":
            if "full_attention" in rope_params:  # transformers >= 5: one rope dict per layer type
                out["rope_theta"], out["rope_scaling"] = _hf_rope(rope_params["full_attention"], 1e6)
                out["rope_local_theta"], local = _hf_rope(rope_params.get("sliding_attention"), 10000.0)
                if local is not None:
                    raise ConfigError("rope_parameters.sliding_attention: scaled local RoPE is not supported")
            else:
                out["rope_local_theta"] = _num(float, hf, "rope_local_base_freq", 10000.0)
        return out
    if act != "silu":
        raise ConfigError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {act!r}")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias: MLP biases are not supported")
    if kind == "llama" and hf.get("attention_bias"):
        raise ConfigError("attention_bias: Llama's o_proj bias is not supported (only Qwen2-style q/k/v biases)")
    if kind in ("qwen3", "qwen3_moe", "qwen2") and hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window: Qwen's per-layer windows (max_window_layers) are not supported")
    if kind in ("qwen3_5_text", "qwen3_5_moe_text"):
        return {**out, **_hf_linear_attention_fields(hf, kind, rope_params)}
    if kind in ("qwen3", "qwen3_moe") and hf.get("attention_bias"):
        raise ConfigError("attention_bias: Qwen3 with attention biases is not supported")
    use_sw = hf.get("use_sliding_window", kind in ("mistral", "mixtral"))
    out.update(
        sliding_window=hf.get("sliding_window") if use_sw else None,
        attention_bias=bool(hf.get("attention_bias", kind == "qwen2")),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if kind == "mixtral":
        out.update(
            num_experts=_num(int, hf, "num_local_experts"), num_experts_per_tok=_num(int, hf, "num_experts_per_tok")
        )
    elif kind == "qwen3_moe":
        if _num(int, hf, "decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(
                "decoder_sparse_step: only Qwen3-MoE with every layer sparse is supported "
                "(decoder_sparse_step 1, no mlp_only_layers)"
            )
        out.update(
            num_experts=_num(int, hf, "num_experts") if hf.get("num_experts") else _num(int, hf, "num_local_experts"),
            num_experts_per_tok=_num(int, hf, "num_experts_per_tok"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            intermediate_size=_num(int, hf, "moe_intermediate_size"),
        )
    return out


def _hf_linear_attention_fields(hf: dict[str, Any], kind: str, rope_params: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's fields: the layer layout (every N-th layer full attention, from `layer_types`), the Gated DeltaNet
    shapes, partial rotary, and (MoE) the experts with their shared expert."""
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias: Qwen3.5 with attention biases is not supported")
    types = hf.get("layer_types")
    if types:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        n = full[0] + 1 if full else 0
        expected = ["full_attention" if n and (i + 1) % n == 0 else "linear_attention" for i in range(len(types))]
        if not n or list(types) != expected:
            raise ConfigError(f"layer_types: only every N-th layer full attention is supported, got {types}")
    else:
        n = _num(int, hf, "full_attention_interval", 4)
    out: dict[str, Any] = dict(
        full_attention_interval=n,
        # transformers' default for Qwen3.5 is a quarter of head_dim
        partial_rotary_factor=_num(float, {**hf, **rope_params}, "partial_rotary_factor", 0.25),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=False,
        sliding_window=None,
    )
    for key in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ):
        out[key] = _num(int, hf, key)
    if kind == "qwen3_5_moe_text":
        out.update(
            num_experts=_num(int, hf, "num_experts"),
            num_experts_per_tok=_num(int, hf, "num_experts_per_tok"),
            norm_topk_prob=True,  # Qwen3.5-MoE's router always renormalises its top-k
            intermediate_size=_num(int, hf, "moe_intermediate_size"),
            shared_expert_intermediate_size=_num(int, hf, "shared_expert_intermediate_size"),
        )
    return out


def _num(cast: type[int] | type[float], hf: dict[str, Any], key: str, default: Any = ...) -> Any:
    """`cast(hf[key])` (or of `default` when absent); a missing or non-numeric value is a ConfigError naming `key`."""
    if key not in hf and default is ...:
        raise ConfigError(f"{key}: missing from config.json")
    value = hf.get(key, default)
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise TypeError
        return cast(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: must be a number, got {str(value)[:60]!r}") from None


def from_hf_config(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Map a Hugging Face `config.json` dict onto a `ModelConfig`, by its `model_type` (`HF_MODEL_TYPES`).

    An unsupported model type, or a feature of a supported one that we do not implement, is a ConfigError.
    """
    kind = _hf_model_type(hf)
    eos = hf.get("eos_token_id", 1 if kind in ("gemma2", "gemma3_text") else 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    num_heads = _num(int, hf, "num_attention_heads")
    if num_heads < 1:
        raise ConfigError(f"num_attention_heads: must be >= 1, got {num_heads}")
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = {"float16": "bfloat16"}.get(dtype, dtype)
    fields: dict[str, Any] = dict(
        name=name,
        vocab_size=_num(int, hf, "vocab_size"),
        hidden_size=_num(int, hf, "hidden_size"),
        intermediate_size=_num(int, hf, "intermediate_size" if "intermediate_size" in hf else "moe_intermediate_size"),
        num_layers=_num(int, hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_num(int, hf, "num_key_value_heads") if hf.get("num_key_value_heads") else num_heads,
        head_dim=_num(int, hf, "head_dim") if hf.get("head_dim") else _num(int, hf, "hidden_size") // num_heads,
        max_position_embeddings=_num(int, hf, "max_position_embeddings", 4096),
        rms_norm_eps=_num(float, hf, "rms_norm_eps", 1e-5),
        dtype=dtype if dtype in DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    fields.update(_hf_family_fields(hf, kind))
    return ModelConfig(**fields)

"""Typed, validated model configuration.

A `ModelConfig` describes a decoder of one of the supported families (`MODEL_TYPES`: Llama 2/3, Mistral
and Qwen2 shapes as "llama", Qwen3, Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE). It loads from a JSON file
under `configs/` (by name, e.g. ``"tiny"`` or ``"llama-3.2-1b"``), from any JSON path, or from a Hugging
Face ``config.json`` (dispatched on its `model_type`). Every bad value fails at load time with a
`ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged_jax.model_files import ModelFileError, read_json_object

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DTYPES = ("float32", "bfloat16")
# --quantization: weights quantized at load (paged_jax.quant); w8a8 also quantizes activations (an int8 dot)
WEIGHT_QUANTIZATIONS = ("int8", "w8a8", "fp8")
KV_DTYPE_CHOICES = ("float32", "bfloat16", "int8", "fp8_e4m3")  # --kv-dtype; the last two: quantized pages
# Our model families; each has its module under paged_jax/model/ (see paged_jax.model.families).
MODEL_TYPES = ("llama", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen3_moe")
GEMMA_TYPES = ("gemma2", "gemma3")
QK_NORM_TYPES = ("qwen3", "gemma3", "qwen3_moe")  # a per-head RMSNorm on q and k before RoPE
ROPE_TYPES = ("llama3", "linear")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3 style (`rope_type == "llama3"`) or linear (`"linear"`, Gemma 3).

    llama3: frequencies with wavelength above `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`; those below `.../high_freq_factor` are kept; in between they blend.
    linear: every frequency is divided by `factor` (positions stretched); the other fields are unused.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def validate(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling.rope_type: must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"rope_scaling.{name}: must be a positive number, got {value!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("rope_scaling.high_freq_factor: must exceed low_freq_factor")
        if self.original_max_position_embeddings <= 0:
            raise ConfigError("rope_scaling.original_max_position_embeddings: must be positive")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder of family `model_type`.

    Sizes are counts (not bytes). `head_dim` defaults to `hidden_size // num_heads`; a config
    may set it explicitly (e.g. Gemma-like shapes) but then `num_heads * head_dim` need not
    equal `hidden_size` only if `head_dim` is given explicitly. For the MoE families
    `intermediate_size` is one expert's (Qwen3-MoE's `moe_intermediate_size`).
    """

    name: str = "custom"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 0  # 0 means hidden_size // num_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2)
    dtype: str = "float32"  # parameter and activation dtype
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    sliding_window: int | None = None  # tokens; None = full attention
    model_type: str = "llama"  # one of MODEL_TYPES: which module of paged_jax/model builds the decoder
    # 0: every layer uses `sliding_window`; N > 0: layer i is global (full attention) when (i + 1) % N == 0 and
    # sliding otherwise (Gemma 2: 2, Gemma 3: 6), as transformers' `layer_types` lays them out.
    sliding_window_pattern: int = 0
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power (None: head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (unscaled); None: rope_theta
    num_experts: int = 0  # MoE: routed experts per layer (0 = dense MLP)
    num_experts_per_tok: int = 0  # MoE: experts each token is routed to (top-k)
    norm_topk_prob: bool = True  # MoE: renormalise the top-k router probabilities to sum to 1 (Mixtral: always)

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self.validate()

    def validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_kv_heads: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_size % self.num_heads != 0 and self.head_dim == self.hidden_size // self.num_heads:
            raise ConfigError(
                f"num_heads: hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for RoPE, got {self.head_dim}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError(f"rope_theta: must be positive, got {self.rope_theta!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        if self.rope_scaling is not None:
            self.rope_scaling.validate()
        for tok in self.eos_token_ids:
            if not (0 <= tok < self.vocab_size):
                raise ConfigError(f"eos_token_ids: {tok} is outside the vocabulary [0, {self.vocab_size})")
        if self.bos_token_id is not None and not (0 <= self.bos_token_id < self.vocab_size):
            raise ConfigError(f"bos_token_id: {self.bos_token_id} is outside the vocabulary")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window: must be positive or null, got {self.sliding_window!r}")
        self._validate_family()

    def _validate_family(self) -> None:
        """The family fields: known model type, experts only for MoE types, positive caps and scalars."""
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type: must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.model_type in MOE_TYPES:
            if not (isinstance(self.num_experts, int) and self.num_experts >= 2):
                raise ConfigError(f"num_experts: {self.model_type} needs at least 2 experts, got {self.num_experts!r}")
            if not (isinstance(self.num_experts_per_tok, int) and 1 <= self.num_experts_per_tok <= self.num_experts):
                raise ConfigError(f"num_experts_per_tok: must be in [1, num_experts], got {self.num_experts_per_tok!r}")
        elif self.num_experts or self.num_experts_per_tok:
            raise ConfigError(
                f"num_experts: only the MoE model types {MOE_TYPES} have experts (model_type is {self.model_type!r})"
            )
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "linear" and self.model_type == "llama":
            raise ConfigError("rope_scaling.rope_type: 'linear' is not supported for the llama family")
        if not (isinstance(self.sliding_window_pattern, int) and self.sliding_window_pattern >= 0):
            raise ConfigError(
                f"sliding_window_pattern: must be a non-negative integer, got {self.sliding_window_pattern!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}: must be positive or null, got {value!r}")

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window (tokens) of layer `layer`, None where it attends to the whole sequence."""
        if self.sliding_window is None:
            return None
        p = self.sliding_window_pattern
        return None if p and (layer + 1) % p == 0 else self.sliding_window

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    @property
    def attn_scale(self) -> float:
        """The softmax scale of q.k: query_pre_attn_scalar ** -0.5 when set (Gemma), else head_dim ** -0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included (all experts of an MoE)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        if self.model_type in QK_NORM_TYPES:
            attn += 2 * d
        mlp = 3 * h * self.intermediate_size
        if self.model_type in MOE_TYPES:
            mlp = self.num_experts * mlp + h * self.num_experts  # experts and the router
        norms = 4 * h if self.model_type in GEMMA_TYPES else 2 * h
        per_layer = attn + mlp + norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def num_active_params(self) -> int:
        """Parameters one token uses: `num_params` with only `num_experts_per_tok` experts per MoE layer."""
        if not self.is_moe:
            return self.num_params()
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params() - self.num_layers * idle * 3 * self.hidden_size * self.intermediate_size

    def family_summary(self) -> str:
        """One line on what this family adds to a Llama decoder (for `paged-jax info`)."""
        parts = [self.model_type]
        if self.model_type in QK_NORM_TYPES:
            parts.append("q/k RMSNorm")
        if self.sliding_window is not None:
            p = self.sliding_window_pattern
            where = f"{p - 1} of every {p} layers" if p else "every layer"
            parts.append(f"sliding window {self.sliding_window} on {where}")
        if self.query_pre_attn_scalar is not None:
            parts.append(f"query scalar {self.query_pre_attn_scalar:g}")
        if self.attn_logit_softcap is not None:
            parts.append(f"attention soft cap {self.attn_logit_softcap:g}")
        if self.final_logit_softcap is not None:
            parts.append(f"final soft cap {self.final_logit_softcap:g}")
        if self.rope_local_theta is not None:
            parts.append(f"RoPE base {self.rope_theta:g} global / {self.rope_local_theta:g} local")
        if self.is_moe:
            parts.append(
                f"{self.num_experts} experts, top {self.num_experts_per_tok} "
                f"({self.num_active_params():,} parameters active per token)"
            )
        return ", ".join(parts)

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out


def _from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown field in {source} (known: {', '.join(sorted(known))})")
    data = dict(data)
    if data.get("rope_scaling") is not None:
        rs = data["rope_scaling"]
        if not isinstance(rs, dict):
            raise ConfigError(f"rope_scaling: must be an object or null, got {rs!r}")
        rs_known = {f.name for f in dataclasses.fields(RopeScaling)}
        bad = sorted(set(rs) - rs_known)
        if bad:
            raise ConfigError(f"rope_scaling.{bad[0]}: unknown field in {source}")
        data["rope_scaling"] = RopeScaling(**rs)
    if "eos_token_ids" in data:
        eos = data["eos_token_ids"]
        data["eos_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    try:
        return ModelConfig(**data)
    except TypeError as e:  # a wrong type that dataclass construction rejects
        raise ConfigError(f"{source}: {e}") from e


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
}


def _hf_model_type(hf: dict[str, Any]) -> str:
    """The HF model type of a config.json (its `model_type`, else from `architectures`); ConfigError if unsupported."""
    arch = (hf.get("architectures") or [None])[0]
    kind = hf.get("model_type") or HF_ARCHITECTURES.get(arch) or ("llama" if arch is None else None)
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
        return int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default)
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
        theta = float(hf["rope_theta"])
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
                out["rope_local_theta"] = float(hf.get("rope_local_base_freq", 10000.0))
        return out
    if act != "silu":
        raise ConfigError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {act!r}")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias: MLP biases are not supported")
    if kind == "llama" and hf.get("attention_bias"):
        raise ConfigError("attention_bias: Llama's o_proj bias is not supported (only Qwen2-style q/k/v biases)")
    if kind in ("qwen3", "qwen3_moe", "qwen2") and hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window: Qwen's per-layer windows (max_window_layers) are not supported")
    if kind in ("qwen3", "qwen3_moe") and hf.get("attention_bias"):
        raise ConfigError("attention_bias: Qwen3 with attention biases is not supported")
    use_sw = hf.get("use_sliding_window", kind in ("mistral", "mixtral"))
    out.update(
        sliding_window=hf.get("sliding_window") if use_sw else None,
        attention_bias=bool(hf.get("attention_bias", kind == "qwen2")),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if kind == "mixtral":
        out.update(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]))
    elif kind == "qwen3_moe":
        if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(
                "decoder_sparse_step: only Qwen3-MoE with every layer sparse is supported "
                "(decoder_sparse_step 1, no mlp_only_layers)"
            )
        out.update(
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            intermediate_size=int(hf["moe_intermediate_size"]),
        )
    return out


def from_hf_config(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Map a Hugging Face `config.json` dict onto a `ModelConfig`, by its `model_type` (`HF_MODEL_TYPES`).

    An unsupported model type, or a feature of a supported one that we do not implement, is a ConfigError.
    """
    kind = _hf_model_type(hf)
    eos = hf.get("eos_token_id", 1 if kind in ("gemma2", "gemma3_text") else 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    num_heads = int(hf["num_attention_heads"])
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = {"float16": "bfloat16"}.get(dtype, dtype)
    fields: dict[str, Any] = dict(
        name=name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        dtype=dtype if dtype in DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
    fields.update(_hf_family_fields(hf, kind))
    return ModelConfig(**fields)


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a config by name (`configs/<name>.json`), from a JSON file, or from an HF model directory."""
    path = Path(name_or_path)
    if path.is_dir():
        try:
            hf = read_json_object(path, "config.json")
        except ModelFileError as e:
            raise ConfigError(f"model: {path}/{e}") from None
        if not hf:
            raise ConfigError(f"model: {path} has no config.json")
        return from_hf_config(hf, name=path.name)
    if path.suffix != ".json":
        path = CONFIG_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ConfigError(f"model: unknown config {name_or_path!r} (available: {', '.join(available_configs())})")
    try:
        data = read_json_object(path.parent, path.name)
    except ModelFileError as e:
        raise ConfigError(f"{path}: {e}") from None
    if not data:
        raise ConfigError(f"{path}: no such file, or an empty JSON object")
    data.setdefault("name", path.stem)
    return _from_dict(data, str(path))


__all__ = [
    "ConfigError",
    "HF_MODEL_TYPES",
    "MODEL_TYPES",
    "ModelConfig",
    "RopeScaling",
    "available_configs",
    "from_hf_config",
    "load_model_config",
]

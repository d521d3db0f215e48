"""Typed, validated model configuration.

A `ModelConfig` describes a decoder of one of the supported families (`MODEL_TYPES`: Llama 2/3, Mistral
and Qwen2 shapes as "llama", Qwen3, Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE). Every bad value fails at
construction with a `ConfigError` naming the field. Where configs come from: `paged_jax.config.loading`
(files under `configs/`, any JSON path, a Hugging Face directory through `paged_jax.config.hf`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

DTYPES = ("float32", "bfloat16")
# --quantization: weights quantized at load (paged_jax.model.quant); w8a8 also quantizes activations (an int8 dot)
WEIGHT_QUANTIZATIONS = ("int8", "w8a8", "fp8")
KV_DTYPE_CHOICES = ("float32", "bfloat16", "int8", "fp8_e4m3")  # --kv-dtype; the last two: quantized pages
# Our model families; each has its module under paged_jax/model/ (see paged_jax.model.families).
MODEL_TYPES = ("llama", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
MOE_TYPES = ("mixtral", "qwen3_moe", "qwen3_5_moe")
# Linear-attention hybrids: Gated DeltaNet layers with a gated full-attention layer every `full_attention_interval`
LINEAR_ATTENTION_TYPES = ("qwen3_5", "qwen3_5_moe")
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
    partial_rotary_factor: float = 1.0  # the fraction of head_dim that RoPE rotates (Qwen3.5: 0.25), the rest passes
    # Linear-attention hybrids (LINEAR_ATTENTION_TYPES): layer i is full attention when (i + 1) % N == 0 and a
    # Gated DeltaNet layer otherwise (Qwen3.5: N = 4); 0 for the other families.
    full_attention_interval: int = 0
    linear_num_key_heads: int = 0  # Gated DeltaNet q/k heads
    linear_num_value_heads: int = 0  # Gated DeltaNet v heads (a multiple of the key heads) = state heads
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0  # the depthwise causal conv1d's width (Qwen3.5: 4)
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: the always-on shared expert's MLP width

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
        if not (0 < self.partial_rotary_factor <= 1) or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor: must be in (0, 1] and rotate an even number of dims, got "
                f"{self.partial_rotary_factor!r} of head_dim {self.head_dim}"
            )
        self._validate_linear_attention()
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

    def _validate_linear_attention(self) -> None:
        """The Gated DeltaNet fields: positive exactly for the hybrid types, value heads grouped over key heads."""
        names = (
            "full_attention_interval",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
        if self.model_type not in LINEAR_ATTENTION_TYPES:
            for name in (*names, "shared_expert_intermediate_size"):
                if getattr(self, name):
                    raise ConfigError(f"{name}: only the linear-attention hybrids {LINEAR_ATTENTION_TYPES} have it")
            return
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: {self.model_type} needs a positive integer, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads: {self.linear_num_value_heads} is not a multiple of linear_num_key_heads "
                f"({self.linear_num_key_heads})"
            )
        if self.model_type == "qwen3_5_moe" and self.shared_expert_intermediate_size <= 0:
            raise ConfigError("shared_expert_intermediate_size: qwen3_5_moe needs a positive shared expert width")

    def is_linear_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet (linear-attention) layer rather than full attention."""
        n = self.full_attention_interval
        return bool(n) and (layer + 1) % n != 0

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V (all but a hybrid's linear-attention layers, which keep a fixed-size state)."""
        return sum(not self.is_linear_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (head_dim unless `partial_rotary_factor` < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        if self.model_type in LINEAR_ATTENTION_TYPES:
            return self._hybrid_num_params()
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

    def _hybrid_num_params(self) -> int:
        """`num_params` of a Qwen3.5 hybrid: gated full attention (q doubled by its output gate, q/k norms) on every
        `full_attention_interval`-th layer, Gated DeltaNet on the others; dense MLP or experts + shared expert."""
        h, d = self.hidden_size, self.head_dim
        full = h * self.num_heads * d * 3 + h * self.num_kv_heads * d * 2 + 2 * d
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        conv = 2 * kd + vd
        linear = h * conv + h * vd + 2 * h * self.linear_num_value_heads + conv * self.linear_conv_kernel_dim
        linear += 2 * self.linear_num_value_heads + self.linear_value_head_dim + vd * h
        mlp = 3 * h * self.intermediate_size
        if self.is_moe:
            mlp = self.num_experts * mlp + h * self.num_experts + 3 * h * self.shared_expert_intermediate_size + h
        layers = sum(linear if self.is_linear_layer(i) else full for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + self.num_layers * (mlp + 2 * h) + embed + h

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
        if self.full_attention_interval:
            n = self.full_attention_interval
            parts.append(f"Gated DeltaNet on {n - 1} of every {n} layers, gated full attention on the rest")
        if self.is_moe:
            parts.append(
                f"{self.num_experts} experts, top {self.num_experts_per_tok} "
                f"({self.num_active_params():,} parameters active per token)"
            )
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return out


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A `ModelConfig` from a JSON object (`source` names it in errors); unknown fields are a ConfigError."""
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

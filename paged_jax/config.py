"""Typed, validated model configuration.

A `ModelConfig` describes a Llama-style decoder. It loads from a JSON file under `configs/`
(by name, e.g. ``"tiny"`` or ``"llama-3.2-1b"``), from any JSON path, or from a Hugging Face
``config.json``. Every bad value fails at load time with a `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DTYPES = ("float32", "bfloat16")
WEIGHT_QUANTIZATIONS = ("int8", "fp8")  # --quantization: weights quantized at load (paged_jax.quant)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type == "llama3"`).

    Frequencies with wavelength above `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`; those below `.../high_freq_factor` are kept; in between they blend.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def validate(self) -> None:
        if self.rope_type != "llama3":
            raise ConfigError(f"rope_scaling.rope_type: only 'llama3' is supported, got {self.rope_type!r}")
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
    """Shape and numerics of a Llama-style decoder.

    Sizes are counts (not bytes). `head_dim` defaults to `hidden_size // num_heads`; a config
    may set it explicitly (e.g. Gemma-like shapes) but then `num_heads * head_dim` need not
    equal `hidden_size` only if `head_dim` is given explicitly.
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

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_kv_heads: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.hidden_size % self.num_heads != 0 and self.head_dim == self.hidden_size // self.num_heads:
            raise ConfigError(
                f"num_heads: hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly")
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

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        if self.attention_bias:
            attn += (self.num_heads + 2 * self.num_kv_heads) * d
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

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


def from_hf_config(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Map a Hugging Face Llama/Mistral/Qwen2 `config.json` dict onto a `ModelConfig`."""
    arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
    supported = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    if arch not in supported:
        raise ConfigError(f"architectures: {arch!r} is not a supported Llama-family model ({supported})")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias: MLP biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act: only 'silu' (SwiGLU) is supported, got {hf['hidden_act']!r}")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        raise ConfigError("attention_bias: Llama's o_proj bias is not supported (only Qwen2-style q/k/v biases)")
    # transformers < 5 writes `rope_theta` and `rope_scaling`; >= 5 nests both in `rope_parameters`
    rope_params = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rs = hf.get("rope_scaling") or rope_params
    rope_scaling = None
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind in (None, "default"):
            rope_scaling = None
        elif kind != "llama3":
            raise ConfigError(f"rope_scaling.rope_type: {kind!r} is not supported (only 'llama3')")
        else:
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
            )
    eos = hf.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    num_heads = int(hf["num_attention_heads"])
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = {"float16": "bfloat16"}.get(dtype, dtype)
    use_sw = hf.get("use_sliding_window", arch == "MistralForCausalLM")
    return ModelConfig(
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
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
        dtype=dtype if dtype in DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        sliding_window=(hf.get("sliding_window") if use_sw else None),
    )


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """Load a config by name (`configs/<name>.json`), from a JSON file, or from an HF model directory."""
    path = Path(name_or_path)
    if path.is_dir():
        hf_path = path / "config.json"
        if not hf_path.exists():
            raise ConfigError(f"model: {path} has no config.json")
        return from_hf_config(json.loads(hf_path.read_text()), name=path.name)
    if path.suffix != ".json":
        path = CONFIG_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ConfigError(f"model: unknown config {name_or_path!r} (available: {', '.join(available_configs())})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    data.setdefault("name", path.stem)
    return _from_dict(data, str(path))


__all__ = ["ConfigError", "ModelConfig", "RopeScaling", "available_configs", "from_hf_config",
           "load_model_config"]

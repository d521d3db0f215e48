"""What is in a PEFT LoRA adapter? Reading `adapter_config.json` + `adapter_model.safetensors` (never pickle)
into per-layer A/B matrices for the projections our decoder has, or a clear error.

PEFT stores, per adapted linear layer, `...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r] (torch's [out, in] layout); the layer computes `base(x) + B(A(x)) * scaling` with
`scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). Here A is kept as [in, r] and B as
[r, out] (our kernels are [in, out]), B's output axis split into heads for q/k/v and its input axis for o:

    q_proj: A [H, r], B [r, Hq, D]      k_proj, v_proj: A [H, r], B [r, Hkv, D]
    o_proj: A [Hq, D, r], B [r, H]      gate_proj, up_proj: A [H, r], B [r, I]      down_proj: A [I, r], B [r, H]

The directory is read as a model directory is (`paged_jax.config.model_files`): regular files inside it only
(weights linked from elsewhere on the machine are refused), `adapter_config.json` capped at 1 MiB, UTF-8, and
parsed with the bounds of `paged_jax.bounded_json`; every weight must be finite and at most `MAX_ABS_WEIGHT`
in magnitude, the scaling at most `MAX_SCALING` (huge-but-finite weights turn every output into padding).

Anything this engine would silently compute differently is refused, naming the adapter and the field or
tensor: DoRA, LoRA biases, `modules_to_save` (whole replaced layers), per-module `rank_pattern` /
`alpha_pattern`, `fan_in_fan_out`, target modules other than the seven above (embeddings, the LM head), MLP
targets on MoE models (their experts are not `gate_proj`/`up_proj`/`down_proj`), and any tensor whose name,
layer or shape does not match the base model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

from paged_jax.bounded_json import load_json
from paged_jax.config import ModelConfig
from paged_jax.config.model_files import ModelFileError, model_file, read_text
from paged_jax.errors import FieldError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES

MAX_CONFIG_BYTES = 2**20  # adapter_config.json (PEFT writes about 1 KiB)
MAX_ABS_WEIGHT = 1e4  # |w| of any A or B entry (trained adapters stay far below 10)
MAX_SCALING = 1e4  # |lora_alpha / r| (or / sqrt(r)): what multiplies every delta
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_TRUE = {
    "use_dora": "DoRA (use_dora) adapters are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
}


class LoraError(FieldError):
    """An adapter that cannot be served as it is: a request's `lora_request` refused, the message naming the
    adapter and the field or tensor."""

    def __init__(self, message: str) -> None:
        super().__init__("lora_request", message)


@dataclass(slots=True)
class LoraAdapter:
    """One adapter on the host, float32, in the layout of the module docstring.

    `layers[i]` maps a module name ("q_proj", ...) to (A, B); modules the adapter does not target are absent.
    `digest` names the weights (config and tensors): the prefix cache keys blocks by it, so two adapters never
    share KV while the same adapter loaded under two names does.
    """

    name: str
    rank: int
    scaling: float
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]
    digest: str
    path: str = ""
    target_modules: tuple[str, ...] = field(default=())

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def _clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per module: (A's input axes, B's output axes) in our layout (ranks left out)."""
    h, d, hq, hkv, i = (
        config.hidden_size,
        config.head_dim,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
    )
    return {
        "q_proj": ((h,), (hq, d)),
        "k_proj": ((h,), (hkv, d)),
        "v_proj": ((h,), (hkv, d)),
        "o_proj": ((hq, d), (h,)),
        "gate_proj": ((h,), (i,)),
        "up_proj": ((h,), (i,)),
        "down_proj": ((i,), (h,)),
    }


def parse_adapter_config(raw: dict, name: str, config: ModelConfig, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from an `adapter_config.json` dict, or LoraError naming the field."""

    def fail(msg: str) -> LoraError:
        return LoraError(f"adapter {name!r}: adapter_config.json: {msg}")

    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type: only LORA adapters are supported, got {peft_type!r}")
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise fail(f"r: must be a positive integer, got {r!r}")
    if r > max_rank:
        raise fail(f"r: rank {r} exceeds max_lora_rank ({max_rank})")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise fail(f"lora_alpha: must be a number, got {alpha!r}")
    for key, msg in _REFUSED_TRUE.items():
        if raw.get(key):
            raise fail(f"{key}: {msg}")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise fail(f"bias: LoRA biases are not supported (bias={raw.get('bias')!r})")
    if raw.get("modules_to_save"):
        raise fail(f"modules_to_save: fully trained modules are not supported, got {raw['modules_to_save']!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise fail(f"{key}: per-module ranks and alphas are not supported, got {raw[key]!r}")
    targets = raw.get("target_modules")
    if targets is not None and not isinstance(targets, str | list):
        raise fail(f"target_modules: must be a list of module names or a regex string, got {_clip(targets)}")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise fail(f"target_modules: must be a list of module names (strings), got {_clip(targets)}")
        bad = [t for t in targets if t.rsplit(".", 1)[-1] not in MODULES]
        if bad:
            raise fail(f"target_modules: {bad} are not among the supported projections {list(MODULES)}")
    scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    if abs(scaling) > MAX_SCALING:
        raise fail(f"lora_alpha: a scaling of {scaling:g} (lora_alpha / r), more than {MAX_SCALING:g} in magnitude")
    del config
    return r, float(scaling)


def _adapter_file(root: Path, name: str, file: str) -> Path | None:
    """`root/file` if it is a regular file inside the adapter directory (`paged_jax.config.model_files`: a link
    out of it, a FIFO or a device is refused as a model directory's would be), None when absent."""
    try:
        return model_file(root, file)
    except ModelFileError as e:
        raise LoraError(f"adapter {name!r}: {e}") from None


def read_adapter_config(path: Path, name: str) -> dict:
    """`adapter_config.json` as a dict: at most `MAX_CONFIG_BYTES`, UTF-8, JSON within the bounds of
    `paged_jax.bounded_json` (depth, integer size), or LoraError naming the file and the place."""
    try:
        raw = load_json(read_text(path, MAX_CONFIG_BYTES), "adapter_config.json")
    except (ModelFileError, FieldError) as e:
        raise LoraError(f"adapter {name!r}: {e}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"adapter {name!r}: adapter_config.json: must hold a JSON object")
    return raw


def read_adapter(
    path: str | Path, name: str, config: ModelConfig, max_rank: int, num_layers: int | None = None
) -> LoraAdapter:
    """Load the adapter directory `path` for a base model of `config` (LoraError when it cannot be served)."""
    root = Path(path)
    cfg_file = _adapter_file(root, name, "adapter_config.json")
    weights_file = _adapter_file(root, name, "adapter_model.safetensors")
    if cfg_file is None:
        raise LoraError(f"adapter {name!r}: no adapter_config.json in {str(root)!r}")
    if weights_file is None:
        hint = " (adapter_model.bin is a pickle and is not read)" if (root / "adapter_model.bin").exists() else ""
        raise LoraError(f"adapter {name!r}: no adapter_model.safetensors in {str(root)!r}{hint}")
    raw = read_adapter_config(cfg_file, name)
    rank, scaling = parse_adapter_config(raw, name, config, max_rank)
    blob = weights_file.read_bytes()
    try:
        with safe_open(str(weights_file), framework="flax") as handle:
            tensors = {k: np.asarray(handle.get_tensor(k), np.float32) for k in handle.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors: {e}") from e
    layers = adapter_layers(tensors, name, config, rank, num_layers)
    digest = hashlib.sha256(json.dumps(raw, sort_keys=True).encode() + blob).hexdigest()
    targets = tuple(sorted({m for layer in layers for m in layer}, key=MODULES.index))
    return LoraAdapter(name, rank, scaling, layers, digest, str(root), targets)


def adapter_layers(
    tensors: dict[str, np.ndarray], name: str, config: ModelConfig, rank: int, num_layers: int | None = None
) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The per-layer (A, B) pairs of PEFT `tensors`, checked against `config` (LoraError naming the tensor)."""
    num_layers = config.num_layers if num_layers is None else num_layers
    shapes = _shapes(config)
    halves: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}  # half "A"/"B" -> (key, tensor)
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"adapter {name!r}: tensor {key!r}: not a LoRA A/B weight of a decoder projection")
        layer, block, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in MODULES or (block == "self_attn") != (module in ATTENTION_MODULES):
            raise LoraError(f"adapter {name!r}: tensor {key!r}: module {block}.{module} is not supported")
        if module in MLP_MODULES and config.is_moe:
            raise LoraError(f"adapter {name!r}: tensor {key!r}: MLP adapters are not supported on MoE models")
        if layer >= num_layers:
            raise LoraError(f"adapter {name!r}: tensor {key!r}: layer {layer}, the model has {num_layers}")
        halves.setdefault((layer, module), {})[half] = (key, value)
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(num_layers)]
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            ((key, _),) = pair.values()
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraError(f"adapter {name!r}: tensor {key!r}: its {missing} partner is missing")
        (a_key, a), (b_key, b) = pair["A"], pair["B"]
        ins, outs = shapes[module]
        if a.shape != (rank, math.prod(ins)):
            raise LoraError(
                f"adapter {name!r}: tensor {a_key!r}: shape {list(a.shape)}, expected {[rank, math.prod(ins)]}"
            )
        if b.shape != (math.prod(outs), rank):
            raise LoraError(
                f"adapter {name!r}: tensor {b_key!r}: shape {list(b.shape)}, expected {[math.prod(outs), rank]}"
            )
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        for key, w in ((a_key, a32), (b_key, b32)):
            if not np.isfinite(w).all():
                raise LoraError(f"adapter {name!r}: tensor {key!r} holds NaN or infinity")
            if w.size and (peak := float(np.abs(w).max())) > MAX_ABS_WEIGHT:
                raise LoraError(
                    f"adapter {name!r}: tensor {key!r} holds {peak:g}, more than {MAX_ABS_WEIGHT:g} in magnitude "
                    "(trained LoRA weights are small; this would drown the base model's activations)"
                )
        layers[layer][module] = (a32.T.reshape(*ins, rank), b32.T.reshape(rank, *outs))
    if not any(layers):
        raise LoraError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return layers


__all__ = ["ATTENTION_MODULES", "MLP_MODULES", "MODULES", "LoraAdapter", "LoraError", "adapter_layers", "read_adapter"]

"""Import a Hugging Face directory (`config.json` + safetensors) of any supported family, without torch or pickle.

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json` (or, failing both,
every `*.safetensors` file), maps HF names onto our tree and transposes HF's [out, in] weights into
our [in, ...out] kernels, then fuses q/k/v and gate/up (`paged_jax.model.loader.fuse`). Every problem raises
`WeightsError` naming the tensor, and is found from the files' headers before any tensor is read (an
unexpected 512 MiB tensor costs nothing); tensors are then read one at a time.
Shard paths must stay inside the model directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config import GEMMA_TYPES, LINEAR_ATTENTION_TYPES, QK_NORM_TYPES, ModelConfig
from paged_jax.config.model_files import ModelFileError, model_file, read_json_object
from paged_jax.model.init import Params
from paged_jax.model.loader.fuse import fuse_params, import_shapes

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors header dtype -> ours


class WeightsError(ValueError):
    """Checkpoint tensors do not fit the model; the message names the tensor."""


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory, via the shard index when there is one."""
    index = "model.safetensors.index.json"
    if model_file(model_dir, index) is not None:
        weight_map = read_json_object(model_dir, index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{model_dir / index}: no 'weight_map' object")
        names: dict[str, str] = {}
        for name, f in weight_map.items():
            if not isinstance(f, str):
                raise WeightsError(f"{name}: its shard {f!r} in {index} is not a file inside {model_dir}")
            names.setdefault(f, name)
        files = []
        for f, name in sorted(names.items()):
            try:
                path = model_file(model_dir, f)
            except ModelFileError as e:
                raise WeightsError(
                    f"{name}: its shard {f!r} in {index} is not a file inside {model_dir} ({e})"
                ) from None
            if path is None:
                raise WeightsError(f"{model_dir / f}: listed in the shard index (for {name}) but missing")
            files.append(path)
    elif (single := model_file(model_dir, "model.safetensors")) is not None:
        files = [single]
    else:
        found = (model_file(model_dir, p.name) for p in sorted(model_dir.glob("*.safetensors")))
        files = [f for f in found if f is not None]
    if not files:
        raise WeightsError(f"{model_dir}: no *.safetensors files (pickled .bin checkpoints are not read)")
    return files


@contextmanager
def _open_safetensors(f: Path) -> Iterator[Any]:
    """`safe_open(f)`; a corrupt or unreadable file is a `WeightsError` naming it (not a bare SafetensorError)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(f), framework="flax")
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{f.name}: not a readable safetensors file ({e})") from None
    with handle:
        yield handle


def _headers(files: list[Path]) -> dict[Path, list[tuple[str, tuple[int, ...], str]]]:
    """(name, shape, dtype) of every tensor, per file, from the headers alone (no tensor data is read)."""
    out = {}
    for f in files:
        with _open_safetensors(f) as handle:
            out[f] = [
                (name, tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
                for name in handle.keys()
            ]
    return out


Rules = dict[str, tuple[tuple[Any, ...], Callable]]  # HF tensor name -> (our path, transform from the HF array)


def _identity(w: Any) -> Any:
    return w


def _transpose(w: Any) -> Any:
    return w.T


# HF names of one MoE layer's router and of expert j's gate, up and down projections, per family.
MOE_NAMES = {
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{j}.w1.weight",
        "block_sparse_moe.experts.{j}.w3.weight",
        "block_sparse_moe.experts.{j}.w2.weight",
    ),
    "qwen3_moe": (
        "mlp.gate.weight",
        "mlp.experts.{j}.gate_proj.weight",
        "mlp.experts.{j}.up_proj.weight",
        "mlp.experts.{j}.down_proj.weight",
    ),
}
MOE_NAMES["qwen3_5_moe"] = MOE_NAMES["qwen3_moe"]


def _mlp_rules(config: ModelConfig, ours: str) -> Rules:
    """The MLP of one layer: dense gate/up/down, or an MoE's router and per-expert projections. A path ending
    in an expert index j is row j of the stacked [E, ...] leaf (stacked by `_stack_experts` after reading)."""
    if not config.is_moe:
        return {
            f"mlp.{proj}.weight": ((ours, "mlp", proj), _transpose) for proj in ("gate_proj", "up_proj", "down_proj")
        }
    router, gate, up, down = MOE_NAMES[config.model_type]
    rules: Rules = {router: ((ours, "mlp", "router"), _transpose)}
    if config.shared_expert_intermediate_size:  # Qwen3.5-MoE's gated shared expert
        rules["mlp.shared_expert_gate.weight"] = ((ours, "mlp", "shared_expert_gate"), _transpose)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            rules[f"mlp.shared_expert.{proj}.weight"] = ((ours, "mlp", "shared_expert", proj), _transpose)
    for j in range(config.num_experts):
        for hf, leaf in ((gate, "experts_gate"), (up, "experts_up"), (down, "experts_down")):
            rules[hf.format(j=j)] = ((ours, "mlp", leaf, j), _transpose)
    return rules


def _layer_rules(config: ModelConfig, i: int) -> Rules:
    """HF tensor name -> (our path, transform from the HF array) for layer i."""
    h, d, hq, hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    pre, ours = f"model.layers.{i}.", f"layers_{i}"
    if config.model_type in LINEAR_ATTENTION_TYPES:
        return {pre + k: v for k, v in _qwen3_5_layer_rules(config, i).items()}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.model_type in GEMMA_TYPES:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    rules: Rules = {f"{norm}.weight": ((ours, norm, "weight"), _identity) for norm in norms}
    rules.update(
        {
            "self_attn.q_proj.weight": ((ours, "self_attn", "q_proj"), lambda w: w.T.reshape(h, hq, d)),
            "self_attn.k_proj.weight": ((ours, "self_attn", "k_proj"), lambda w: w.T.reshape(h, hkv, d)),
            "self_attn.v_proj.weight": ((ours, "self_attn", "v_proj"), lambda w: w.T.reshape(h, hkv, d)),
            "self_attn.o_proj.weight": ((ours, "self_attn", "o_proj"), lambda w: w.T.reshape(hq, d, h)),
        }
    )
    if config.attention_bias:
        for proj, heads in (("q", hq), ("k", hkv), ("v", hkv)):
            rules[f"self_attn.{proj}_proj.bias"] = (
                (ours, "self_attn", f"{proj}_bias"),
                lambda w, n=heads: w.reshape(n, d),
            )
    if config.model_type in QK_NORM_TYPES:
        for norm in ("q_norm", "k_norm"):
            rules[f"self_attn.{norm}.weight"] = ((ours, "self_attn", norm, "weight"), _identity)
    rules.update(_mlp_rules(config, ours))
    return {pre + k: v for k, v in rules.items()}


def _qwen3_5_layer_rules(config: ModelConfig, i: int) -> Rules:
    """Layer i of Qwen3.5 (`paged_jax.model.qwen3_5`): a Gated DeltaNet or a gated full-attention layer, then the
    MLP; names relative to `model.layers.{i}.`."""
    h, d, hq, hkv = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads
    ours = f"layers_{i}"
    norms = ("input_layernorm", "post_attention_layernorm")
    rules: Rules = {f"{n}.weight": ((ours, n, "weight"), _identity) for n in norms}
    if config.is_linear_layer(i):
        la = "linear_attn"
        for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            rules[f"{la}.{proj}.weight"] = ((ours, la, proj), _transpose)
        rules[f"{la}.conv1d.weight"] = ((ours, la, "conv1d"), lambda w: w[:, 0, :].T)  # [C, 1, K] -> [K, C]
        for leaf in ("A_log", "dt_bias"):
            rules[f"{la}.{leaf}"] = ((ours, la, leaf), _identity)
        rules[f"{la}.norm.weight"] = ((ours, la, "norm_weight"), _identity)
    else:
        rules.update(
            {
                "self_attn.q_proj.weight": ((ours, "self_attn", "q_proj_gated"), lambda w: w.T.reshape(h, hq, 2, d)),
                "self_attn.k_proj.weight": ((ours, "self_attn", "k_proj"), lambda w: w.T.reshape(h, hkv, d)),
                "self_attn.v_proj.weight": ((ours, "self_attn", "v_proj"), lambda w: w.T.reshape(h, hkv, d)),
                "self_attn.o_proj.weight": ((ours, "self_attn", "o_proj"), lambda w: w.T.reshape(hq, d, h)),
            }
        )
        for norm in ("q_norm", "k_norm"):
            rules[f"self_attn.{norm}.weight"] = ((ours, "self_attn", norm, "weight"), _identity)
    rules.update(_mlp_rules(config, ours))
    return rules


def hf_name_map(config: ModelConfig) -> Rules:
    """Every HF tensor name the model needs -> (our parameter path, transform)."""
    rules: Rules = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), lambda w: w),
        "model.norm.weight": (("norm", "weight"), lambda w: w),
    }
    if not config.tie_word_embeddings:
        rules["lm_head.weight"] = (("lm_head",), lambda w: w.T)
    for i in range(config.num_layers):
        rules.update(_layer_rules(config, i))
    return rules


def _get(tree: dict, path: tuple[Any, ...]) -> jax.ShapeDtypeStruct:
    """The abstract leaf at `path`; a trailing expert index gives that expert's row of the stacked leaf."""
    *keys, last = path
    node: Any = tree
    for key in keys:
        node = node[key]
    if isinstance(last, int):
        return jax.ShapeDtypeStruct(node.shape[1:], node.dtype)
    return node[last]


def _set(tree: dict, path: tuple[Any, ...], value: jax.Array) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _stack_experts(tree: dict) -> dict:
    """Replace every {0: row, 1: row, ...} node (one expert per key) by the rows stacked in expert order."""
    for key, node in tree.items():
        if isinstance(node, dict):
            if node and all(isinstance(j, int) for j in node):
                tree[key] = jnp.stack([node[j] for j in range(len(node))])
            else:
                _stack_experts(node)
    return tree


def _hf_shape(name: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF [out, in] shape of a tensor whose kernel we store as `ours` ([in, ...out] or [Hq, D, H])."""
    if name.endswith("o_proj.weight"):
        return (ours[2], ours[0] * ours[1])
    if name.endswith("conv1d.weight"):  # ours [K, C], HF's depthwise Conv1d [C, 1, K]
        return (ours[1], 1, ours[0])
    if len(ours) == 4:  # Qwen3.5's q_proj with its output gate [H, Hq, 2, D]
        return (ours[1] * ours[2] * ours[3], ours[0])
    if name.endswith("_proj.bias"):
        return (ours[0] * ours[1],)
    if len(ours) == 3:
        return (ours[1] * ours[2], ours[0])
    if len(ours) == 2 and name != "model.embed_tokens.weight":
        return (ours[1], ours[0])
    return ours


class _TensorCheck:
    """Which checkpoint tensors the config takes, each checked once: known name, no duplicate, a float dtype,
    the shape the config implies. `source` names the checkpoint in errors."""

    def __init__(self, config: ModelConfig, source: str):
        self.rules = hf_name_map(config)
        self.shapes = import_shapes(config)["params"]  # one kernel per projection, as stored
        self.tied = config.tie_word_embeddings
        self.source = source
        self.seen: set[str] = set()

    def accept(self, name: str, shape: tuple[int, ...], dtype_name: str) -> bool:
        """True when the tensor is loaded, False when it is skipped; raises `WeightsError` otherwise."""
        if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.tied):
            return False  # tied checkpoints sometimes store the head too; the embedding is used
        if name not in self.rules:
            raise WeightsError(f"{name}: unexpected tensor in {self.source} (not part of this model's config)")
        if name in self.seen:
            raise WeightsError(f"{name}: stored twice in {self.source}")
        self.seen.add(name)
        if dtype_name not in FLOAT_DTYPES.values():
            raise WeightsError(f"{name}: dtype {dtype_name} cannot be loaded (need float32/bfloat16/float16)")
        hf_shape = _hf_shape(name, tuple(_get(self.shapes, self.rules[name][0]).shape))
        if tuple(shape) != hf_shape:
            raise WeightsError(f"{name}: shape {tuple(shape)} does not fit the config (expected {hf_shape})")
        return True

    def finish(self) -> None:
        missing = sorted(set(self.rules) - self.seen)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise WeightsError(f"{missing[0]}: missing from {self.source}{more}")


def load_hf_params(model_dir: str | Path, config: ModelConfig) -> Params:
    """Parameters from an HF directory's safetensors, cast to `config.dtype`. Raises `WeightsError`."""
    model_dir = Path(model_dir)
    check = _TensorCheck(config, str(model_dir))
    wanted: dict[Path, list[str]] = {}  # file -> the tensors to read from it
    for f, tensors in _headers(safetensors_files(model_dir)).items():
        for name, shape, stored in tensors:
            if check.accept(name, shape, FLOAT_DTYPES.get(stored) or _dtype_name(stored)):
                wanted.setdefault(f, []).append(name)
    check.finish()
    return fuse_params(config, {"params": _stack_experts(_read(wanted, check.rules, jnp.dtype(config.dtype)))})


def _dtype_name(stored: str) -> str:
    """A safetensors header dtype ("I32") as numpy spells it ("int32")."""
    kinds = {"F": "float", "I": "int", "U": "uint", "BF": "bfloat"}
    kind = stored.rstrip("0123456789")
    return f"{kinds[kind]}{stored[len(kind) :]}" if kind in kinds else stored.lower()


def _read(wanted: dict[Path, list[str]], rules: Rules, dtype: jnp.dtype) -> dict:
    """Read the checked tensors one at a time into our tree (each freed on the host before the next)."""
    params: dict = {}
    for f, names in wanted.items():
        with _open_safetensors(f) as handle:
            for name in names:
                path, transform = rules[name]
                _set(params, path, jnp.asarray(transform(handle.get_tensor(name)), dtype=dtype))
    return params


def params_from_hf_tensors(tensors: Iterable[tuple[str, Any]], config: ModelConfig, source: str) -> Params:
    """Our parameter tree from (HF tensor name, [out, in] array) pairs, consumed one at a time (the GGUF
    importer's path: its tensors are dequantized as they are read, so there is no header to check first).

    Every tensor the config needs must appear exactly once; each is checked as `load_hf_params` checks
    headers, transformed into our layout and cast to `config.dtype`. `source` names the checkpoint in errors.
    """
    check = _TensorCheck(config, source)
    dtype = jnp.dtype(config.dtype)
    params: dict = {}
    for name, tensor in tensors:
        if check.accept(name, tuple(tensor.shape), jnp.dtype(tensor.dtype).name):
            path, transform = check.rules[name]
            _set(params, path, jnp.asarray(transform(tensor), dtype=dtype))
    check.finish()
    return fuse_params(config, {"params": _stack_experts(params)})


__all__ = ["WeightsError", "hf_name_map", "load_hf_params", "params_from_hf_tensors", "safetensors_files"]

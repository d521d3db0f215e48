"""The engine's step executables, compiled for a target this process cannot run on (a deviceless TPU or GPU).

`abstract_engine` builds the runner an `LLMEngine` would build for a model config and an `EngineConfig` on
`devices` (compile-only devices from `jax.experimental.topologies`: libtpu for TPUs, jax's CUDA plugin for an
H200): the same run config (KV heads replicated for TP), parameter layout (`paged_jax.worker.sharding`), page
count (`kv_capacity_pages` with the memory the target would report, the weights in use), LoRA slots and verify
rows (`make_runner`), but abstract: parameters, pages and adapter slots are `jax.ShapeDtypeStruct`s and nothing
is allocated. Its jobs (`forward_job`, `sample_job`, ...) are the ones warm-up compiles, so the compile checks
(`scripts/checks/check_tpu_compile.py`, `scripts/checks/check_gpu_compile.py`) compile exactly the engine's
executables and
follow every change to the step's operands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import make_runner
from paged_jax.model import quant, scan
from paged_jax.model.init import param_shapes
from paged_jax.model.linear_state import LinearState
from paged_jax.worker import sharding
from paged_jax.worker.buckets import bucket_for
from paged_jax.worker.compile_jobs import Job
from paged_jax.worker.kv_budget import engine_kv_layout, kv_capacity_pages
from paged_jax.worker.runner import ModelRunner
from paged_jax.worker.step_inputs import SamplerFlags


@dataclass(frozen=True, slots=True)
class AbstractEngine:
    """An abstract runner and the per-device facts the compile checks judge its steps by."""

    runner: ModelRunner
    mesh: jax.sharding.Mesh  # the engine's devices (one for TP 1); lowering runs under it (Pallas reads the target)
    weights_bytes: int  # one device's share of the parameters
    layer_kv_bytes: int  # one device's share of one layer's cache (pages, and scales of quantized pages)
    local_kv_shape: tuple[int, ...]  # one device's page array of one layer (scanned: of the stacked array)
    local_scales_shape: tuple[int, ...] | None = None  # quantized pages: one device's scale array, the same way
    # a linear-attention hybrid (Qwen3.5): one linear layer's state-pool arrays per device, (shape, dtype) of its
    # conv [N, K - 1, C] and recurrent [N, Hv, Dk, Dv] rows (`paged_jax.model.linear_state`); () for other models
    state_arrays: tuple[tuple[tuple[int, ...], np.dtype], ...] = ()

    @property
    def cache_arrays(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        """Every per-layer cache array a step must update in place, as `(shape, dtype)` per device: the KV pages,
        quantized pages' scales, and a hybrid's state-pool arrays (what `paged_jax.worker.hlo_audit.cache_copies`
        looks for)."""
        out = [(self.local_kv_shape, np.dtype(self.runner.kv_dtype))]
        if self.local_scales_shape is not None:
            out.append((self.local_scales_shape, np.dtype(np.float32)))
        return out + list(self.state_arrays)

    @property
    def state_pool_bytes(self) -> int:
        """One device's recurrent-state pool over every linear layer (0 for a model without linear layers)."""
        per_layer = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for shape, dt in self.state_arrays)
        return per_layer * (self.runner.config.num_layers - self.runner.config.num_kv_layers)

    @property
    def kv_tokens(self) -> int:
        """Token slots of the cache (the null page excluded)."""
        return (self.runner.num_pages - 1) * self.runner.page_size  # pages per layer

    def lower(self, job: Job) -> jax.stages.Lowered:
        """Lower one of the runner's jobs for the target (compile it with `job.options`, as the engine does)."""
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return job.lower()

    def compile(self, job: Job) -> jax.stages.Compiled:
        """One of the runner's jobs compiled for the target, with the job's own compiler options."""
        return self.lower(job).compile(dict(job.options) or None)


def _local_bytes(x: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize


def abstract_engine(
    config: ModelConfig,
    ec: EngineConfig,
    devices: Sequence[jax.Device],
    bytes_limit: int,
    weights: tuple[str, bool, bool] | None = None,
) -> AbstractEngine:
    """The engine's runner for `config` and `ec` on `devices` (`ec.tensor_parallel_size` of them), abstract.

    `bytes_limit`: the memory one device would report to the engine (`memory_stats()["bytes_limit"]`), of
    which the weights are in use; `weights`: `paged_jax.model.quant.weights_key` of quantized parameters (None:
    the model dtype). `ec.attention_backend` must name the target's kernel (`pallas-tpu`, `pallas-gpu`): "auto"
    would pick this process's platform."""
    ec.validate()
    tp = ec.tensor_parallel_size
    if len(devices) != tp:
        raise ValueError(f"devices: tensor_parallel_size is {tp} but {len(devices)} devices were given")
    mesh = sharding.make_mesh(devices)
    run_config = config
    if tp > 1:
        run_config = config.replace(num_kv_heads=config.num_kv_heads * sharding.kv_replication(config, tp))
    shapes = quant.abstract_params(param_shapes(run_config), weights)
    if tp > 1:
        placement = sharding.param_shardings(run_config, mesh, shapes)
    else:
        placement = jax.tree.map(lambda _: SingleDeviceSharding(devices[0]), shapes)
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, placement)
    weights_bytes = sum(_local_bytes(x) for x in jax.tree.leaves(params))
    max_model_len = ec.model_len(config.max_position_embeddings)
    kv_dtype = quant.kv_cache_dtype(ec.kv_dtype, config.dtype)
    stats = {"bytes_limit": bytes_limit, "bytes_in_use": weights_bytes}
    platform = devices[0].platform
    layout = engine_kv_layout(config, ec)
    num_pages = kv_capacity_pages(run_config, ec, kv_dtype, None, tp, max_model_len, stats, platform, layout)
    runner = make_runner(
        run_config, params, ec, num_pages, max_model_len, mesh if tp > 1 else None, layout, abstract=True
    )
    # One KV array: the first full-attention layer's, or the scanned decoder's stacked one
    # (`paged_jax.model.scan`), whose share of one layer is its size over the layers. A hybrid's linear layers
    # hold state-pool arrays instead (`LinearState`).
    caches = [runner.kv_caches] if runner.scan else list(runner.kv_caches)
    layer = jax.tree.leaves(next(c for c in caches if not isinstance(c, LinearState)))
    linear = next((c for c in caches if isinstance(c, LinearState)), None)
    state = () if linear is None else tuple((_local_shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves(linear))
    layers = runner.num_slabs if runner.scan else 1
    return AbstractEngine(
        runner,
        mesh,
        weights_bytes,
        sum(_local_bytes(x) for x in layer) // layers,
        _local_shape(layer[0]),
        _local_shape(layer[1]) if len(layer) > 1 else None,
        state,
    )


def _local_shape(x: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    return tuple(x.sharding.shard_shape(x.shape))


STEP_KINDS = ("decode", "prefill", "verify")


def step_shape(runner: ModelRunner, kind: str) -> tuple[int, int]:
    """(tokens, sequences) of the runner's forward step of one kind: `decode` (the token bucket of
    `max_num_seqs` tokens), `prefill` (the largest bucket: chunks, with decodes beside them), `verify`
    (speculation: every sequence verifying all its drafts, `max_num_seqs x (1 + k)` tokens and sample rows)."""
    buckets = runner.token_buckets
    if kind == "decode":
        t = bucket_for(runner.max_num_seqs, buckets)
        return t, runner.seq_bucket(t)
    if kind == "prefill":
        return buckets[-1], runner.seq_bucket(buckets[-1])
    if kind == "verify":
        if not runner.num_speculative_tokens:
            raise ValueError("kind: a verify step needs an engine with speculative_config")
        t = bucket_for(min(runner.max_num_seqs * (1 + runner.num_speculative_tokens), buckets[-1]), buckets)
        return t, runner.step_seq_buckets(t)[-1]
    raise ValueError(f"kind: must be one of {STEP_KINDS}, got {kind!r}")


def step_job(runner: ModelRunner, kind: str) -> Job:
    """The runner's own forward job of `step_shape(runner, kind)`."""
    return runner.jobs.forward(*step_shape(runner, kind))


def verify_sample_job(runner: ModelRunner) -> Job:
    """The runner's sampling job of a full verify step's rows (top-k/p filtered, rejected rows marked)."""
    _, s = step_shape(runner, "verify")
    return runner.jobs.sample(
        s, runner.suppress_width, 1, SamplerFlags(True, True, False, False), runner.logit_bias_width
    )


@dataclass(frozen=True, slots=True)
class StepAudit:
    """What a compiled step does with the KV cache and memory on one device."""

    copies: list[str]  # instructions copying a per-layer cache array (`AbstractEngine.cache_arrays`)
    temp_bytes: int  # XLA's temporaries
    peak_bytes: int  # arguments + outputs - aliased (the donated pages) + temporaries

    def fits(self, bytes_limit: int) -> bool:
        return self.peak_bytes <= bytes_limit


def layer_weight_shapes(engine: AbstractEngine) -> list[tuple[tuple[int, ...], np.dtype]]:
    """One layer's weights, per device: `(shape, dtype)` of every leaf of layer 0 (a hybrid's: of its first
    layer of each kind, linear and full attention; scanned: of the stacked tree, its leading layer axis dropped,
    in the stacked and in the per-layer axis order where they differ: `paged_jax.model.scan.stacked_order`);
    what `paged_jax.worker.hlo_audit.weight_copies` looks for."""
    tree = engine.runner.params["params"]
    if not engine.runner.scan:
        config = engine.runner.config
        first: dict[bool, int] = {}  # layer kind (linear?) -> its first layer
        for i in range(config.num_layers):
            first.setdefault(config.is_linear_layer(i), i)
        out: list[tuple[tuple[int, ...], np.dtype]] = []
        for i in sorted(first.values()):
            for x in jax.tree.leaves(tree[f"layers_{i}"]):
                if (s := (_local_shape(x), np.dtype(x.dtype))) not in out:
                    out.append(s)
        return out
    local = lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape)[1:], x.dtype)
    stacked = jax.tree.map(local, tree[scan.LAYERS])
    layer = jax.eval_shape(partial(scan.to_layer_order, order=engine.runner.stacked_order), stacked)
    out = [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(stacked)]
    return out + [s for s in ((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(layer)) if s not in out]


def audit_step(compiled: jax.stages.Compiled, engine: AbstractEngine) -> StepAudit:
    """The KV copies and memory of one of `engine`'s compiled steps."""
    from paged_jax.worker.hlo_audit import cache_copies

    m, text = compiled.memory_analysis(), compiled.as_text()
    assert m is not None and text is not None, "XLA reports the memory and the HLO of a compiled step"
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    copies = cache_copies(text, engine.cache_arrays)
    return StepAudit(copies, m.temp_size_in_bytes, peak)

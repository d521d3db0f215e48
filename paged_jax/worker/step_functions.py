"""Which jitted functions does a step run? The forward step, the prompt-logprob step, the copy-on-write page copy,
the LoRA slot write and the sampler, each built once per `StepKey` and shared by every runner of the process with
the same key (so engines in one process share compilations).

With a mesh, attention runs per TP shard (`shard_map`) and the operands are pinned to the mesh: params by their
partition specs, KV pages by KV heads, metadata and logits replicated, LoRA arrays like their base weights
(`paged_jax.lora.weights`). See `paged_jax.worker.sharding` for the layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

import pallas_kernels
from paged_jax.config import ModelConfig
from paged_jax.lora import weights as lora_weights
from paged_jax.lora.delta import LoraBatch
from paged_jax.model.families import causal_lm
from paged_jax.model.linear_state import LinearState
from paged_jax.model.scan import StackedOrder
from paged_jax.worker import sharding
from paged_jax.worker.paged_attention import GroupedPages, PagedMeta, paged_attention
from paged_jax.worker.prompt_logprobs import make_prompt_logprobs
from paged_jax.worker.sampler import SamplerOutput, SamplingMeta, sample
from paged_jax.worker.spec_verify import VerifyRows, mask_rejected
from paged_jax.worker.step_inputs import SamplerFlags

GREEDY = SamplerFlags(False, False, False, False)


@dataclass(frozen=True, slots=True)
class LoraShape:
    """The LoRA device arrays' static shape: `max_loras` slots (1..max_loras; slot 0, none, has no arrays) of rank
    `max_rank`."""

    max_loras: int
    max_rank: int


@dataclass(frozen=True, slots=True)
class StepKey:
    """What a step's jitted functions are built from (the same key gives the same functions).

    `backend`: the attention backend as configured ("auto", "xla", "cpu", ...). `quantized_kv`: int8 / fp8
    pages. `weights`: `paged_jax.model.quant.weights_key` of the parameters (None: float weights). `lora`: the
    adapters' slot shape, None when off. `onednn`: the forward step is compiled with oneDNN dots
    (`paged_jax.worker.xla_flags`), so the LM head returns its logits rounded to the model's dtype (the form
    oneDNN's dot takes) before they are widened to float32. `scan`: the scanned decoder (kv_caches is the one
    stacked cache and params the stacked tree, `paged_jax.model.scan`), else a tuple of per-layer caches;
    `stacked_order`: the stacked weights' axis order (`paged_jax.model.scan.stacked_order`). `grouped`: the KV cache
    groups' per-layer tables and slabs (`paged_jax.worker.paged_attention.GroupedPages`; scanned only), None for
    one group."""

    config: ModelConfig
    backend: str
    mesh: jax.sharding.Mesh | None = None
    quantized_kv: bool = False
    weights: tuple[str, bool, bool] | None = None
    lora: LoraShape | None = None
    onednn: bool = False
    scan: bool = False
    stacked_order: StackedOrder = ()
    grouped: GroupedPages | None = None


@functools.cache
def step_functions(key: StepKey):
    """The model and its jitted forward step for `key`.

    forward(params, kv_caches, token_ids [T], positions [T], meta, logits_indices [S], lora)
        -> (logits [S, V] f32, kv_caches, hidden [T, H] after the final norm), with kv_caches donated; `lora` a
        `LoraBatch`, or None when off.
    """
    config, mesh = key.config, key.mesh
    attn: Callable[..., Any] = partial(
        paged_attention, backend=key.backend, sliding_window=config.sliding_window, grouped=key.grouped
    )
    if mesh is not None:
        attn = sharding.shard_attention(attn, mesh, key.quantized_kv)
    model = causal_lm(config, attn, mesh, scan_layers=key.scan, stacked_order=key.stacked_order)
    scan, onednn = key.scan, key.onednn

    def forward(
        params, kv_caches, token_ids, positions, meta: PagedMeta, logits_indices, lora: LoraBatch | None = None
    ):
        hidden, kv_caches = model.apply(params, token_ids, positions, kv_caches, meta, lora)
        logits = model.apply(params, hidden[logits_indices], round_to_dtype=onednn, method="compute_logits")
        return logits, kv_caches if scan else tuple(kv_caches), hidden

    if mesh is None:
        return model, jax.jit(forward, donate_argnums=(1,))
    shardings = sharding.step_shardings(config, mesh, key.quantized_kv, key.weights, scan, key.stacked_order)
    rep = sharding.replicated(mesh)
    lora_in = None if key.lora is None else LoraBatch(lora_shardings(config, mesh, key.lora, scan), rep)  # type: ignore[arg-type]  # shardings stand in for arrays
    shardings["in_shardings"] = (*shardings["in_shardings"], lora_in)
    return model, jax.jit(forward, donate_argnums=(1,), **shardings)


def lora_shardings(
    config: ModelConfig, mesh: jax.sharding.Mesh, lora: LoraShape, stacked: bool
) -> lora_weights.LoraWeights:
    """The LoRA arrays' shardings on `mesh`, stacked (the scanned decoder) or per layer (`paged_jax.lora.weights`)."""
    specs = lora_weights.partition_specs(config, lora.max_loras, lora.max_rank, stacked, sharding.TP)
    return jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


@functools.cache
def lora_writer(config: ModelConfig, mesh: jax.sharding.Mesh | None, lora: LoraShape, stacked: bool):
    """`paged_jax.lora.weights.write_slot` jitted with the arrays donated (kept in their mesh layout)."""
    if mesh is None:
        return jax.jit(lora_weights.write_slot, donate_argnums=(0,))
    shardings = lora_shardings(config, mesh, lora, stacked)
    return jax.jit(lora_weights.write_slot, donate_argnums=(0,), out_shardings=shardings)


@functools.cache
def prompt_logprobs_function(key: StepKey):
    """The jitted prompt-logprob step (`paged_jax.worker.prompt_logprobs`) of `step_functions`' model (without
    adapters and oneDNN dots: the step reads the forward step's final hidden states)."""
    model, _ = step_functions(dataclasses.replace(key, lora=None, onednn=False))
    shardings = None
    if key.mesh is not None:
        shardings = sharding.logits_shardings(key.config, key.mesh, key.weights, key.scan, key.stacked_order)
    return make_prompt_logprobs(model, shardings)


def _copy_all_pages(kv_caches, src, dst):
    """Every layer's pages; a linear layer's state pool (`LinearState`, hybrids) passes through."""
    return tuple(kv if isinstance(kv, LinearState) else pallas_kernels.copy_pages(kv, src, dst) for kv in kv_caches)


@functools.cache
def copy_pages_function(num_layers: int, scan: bool, mesh: jax.sharding.Mesh | None = None, quantized_kv: bool = False):
    """Copy-on-write of pages on every layer (per-layer caches, or the stacked one with `scan`), jitted with the
    caches donated and, with a mesh, kept in their mesh layout (so donation stays in place)."""
    copy = partial(pallas_kernels.copy_stacked_pages, num_layers=num_layers) if scan else _copy_all_pages
    if mesh is None:
        return jax.jit(copy, donate_argnums=(0,))
    kv = sharding.kv_cache_sharding(mesh, quantized_kv)
    return jax.jit(copy, donate_argnums=(0,), out_shardings=kv if scan else (kv,) * num_layers)


@partial(jax.jit, static_argnames=("width", "do_sample", "do_filter", "do_penalty", "want_logprobs"))
def sample_rows(
    logits: jax.Array,
    meta: SamplingMeta,
    bitmask: jax.Array,
    verify: VerifyRows | None = None,
    *,
    width: int,
    do_sample: bool,
    do_filter: bool,
    do_penalty: bool,
    want_logprobs: bool,
) -> SamplerOutput:
    """`sample`, with the ids padded to `width` rows so that the next step's merge has one shape per `T`. With
    `verify` (an engine that speculates, every step) rows whose drafts were rejected read `REJECTED`."""
    out = sample(
        logits,
        meta,
        bitmask,
        do_sample=do_sample,
        do_filter=do_filter,
        do_penalty=do_penalty,
        want_logprobs=want_logprobs,
    )
    tokens = out.tokens if verify is None else mask_rejected(out.tokens, verify.next_draft, verify.row_start)  # type: ignore[arg-type]  # VerifyRows is typed as its host arrays; traced here
    return out._replace(tokens=jnp.pad(tokens, (0, width - tokens.shape[0])))

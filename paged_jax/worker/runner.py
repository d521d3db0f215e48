"""Where does a step run? The bucket choice, the jitted device step and its executables.

The KV cache is one page array per layer, `[num_pages, num_kv_heads, page_size, 2 * head_dim]`
(K then V of a head along the last axis; see `pallas_kernels.common`), donated to every step so it is
updated in place. A scanned decoder (`paged_jax.model.scan`, the default where the model allows it) keeps all
layers in one array `[num_layers * num_pages, ...]` instead (layer l's page p at `l * num_pages + p`; the block
tables and slot mappings name pages of one layer and each layer's attention call adds its offset), and its
parameters stacked on a leading layer axis (`stack_layers`, once, here).
Each step's inputs are numpy arrays padded to a token bucket `T` (powers of two from 16) and a sequence
bucket `S`, built from the scheduler's output by `paged_jax.worker.step_inputs` (the runner never reads the KV
manager: the scheduler's output carries each sequence's page ids); the forward pass returns logits only for
the rows that sample (and its final hidden states, from which a step with prompt-logprob positions computes
theirs, `paged_jax.worker.prompt_logprobs`); sampling is a second jitted call on device; the host receives only the
sampled ids (and requested logprobs).

Which parts need the sequence bucket: the token-level work (embedding, projections, RoPE, the KV write, the
MLP) depends on `T` alone; `S` sizes the attention metadata, the LM head's rows and sampling, and only the
last two cost anything when padded (README: "Sequence buckets"). So `S` is derived from `T`,
`S = bucket(min(T, max_num_seqs))` (a step never holds more sequences than tokens), raised only when one step
samples more rows than that (`n` > 1 samples of a short prompt): one executable per token bucket, not one per
(T, S) pair. The sampler's output ids are padded to the largest `S`, so the lookahead's on-device merge of
the previous step's ids is one executable per `T` as well.

Executables are compiled ahead of time (`paged_jax.worker.executables`): warm-up compiles the shapes a run can
reach on a thread pool (`paged_jax.worker.warmup` says which); a shape first needed after warm-up is compiled
then, counted, and logged as a warning with its shape.

With a device mesh (tensor parallelism, or a data-parallel replica on devices other than the default) the
same step runs with its operands pinned to the mesh; see `paged_jax.worker.sharding` for the layout.

With LoRA on (`LoraShape`), the runner owns the adapters' stacked device arrays (`paged_jax.lora.weights`): the
scheduler's `lora_loads` are written into their slots before the step (one executable for every slot), and the
forward step takes the arrays and each token's slot id; its shapes do not depend on which adapters run.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from paged_jax.config import ModelConfig
from paged_jax.kv_cache import PageCopy
from paged_jax.lora import weights as lora_weights
from paged_jax.lora.delta import LoraBatch
from paged_jax.lora.registry import SlotLoad
from paged_jax.model import quant
from paged_jax.model.attention import LayerPages
from paged_jax.model.families import causal_lm
from paged_jax.model.scan import StackedOrder, stack_layers, stacked_order, use_scan
from paged_jax.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from paged_jax.sched.output import SchedulerOutput
from paged_jax.structured.bitmask import all_allowed, mask_words
from paged_jax.worker import sharding, xla_flags
from paged_jax.worker.executable_store import open_store
from paged_jax.worker.executables import CompilerOptions, CompileStats, Executables
from paged_jax.worker.pending import merge_pending, merge_pending_history
from paged_jax.worker.prompt_logprobs import PromptLogprobs, build_prompt_rows, make_prompt_logprobs
from paged_jax.worker.sampler import SamplerOutput, SamplingMeta, empty_meta, sample
from paged_jax.worker.spec_verify import VerifyRows, mask_rejected, verify_rows
from paged_jax.worker.step_inputs import SamplerFlags, SamplingInputs, build_sampling_inputs, build_step_inputs
from pallas_kernels import cpu_paged, kv_quant
from pallas_kernels.common import cdiv, kv_pages_shape

log = logging.getLogger(__name__)


@flax.struct.dataclass
class PagedMeta:
    """Per-step attention metadata shared by all layers (see `pallas_kernels.ragged_paged_attention`)."""

    slot_mapping: jax.Array  # [T] i32 physical slot of each new token; -1 for padding tokens
    kv_lens: jax.Array  # [S] i32 keys per sequence after this step (0 for padding sequences)
    block_tables: jax.Array  # [S, max_blocks] i32 physical page of each logical block (0 = null page)
    cu_q_lens: jax.Array  # [S + 1] i32 cumulative query counts
    num_seqs: jax.Array  # [1] i32


def paged_attention(
    q,
    k,
    v,
    kv_pages,
    meta: PagedMeta,
    *,
    sm_scale: float,
    backend: str,
    sliding_window: int | None,
    soft_cap: float | None = None,
):
    """The model's `AttentionFn` over paged KV: write this step's K/V into pages, then attend.

    The model passes each layer's `sliding_window` and `soft_cap` (the config's window is only the default).
    `kv_pages`: one layer's pages, or a scanned decoder's `LayerPages` view of the stacked pages (the layer's
    page offset is then applied by the write and inside the attention call, so no layer is sliced out)."""
    view, offset = None, None
    if isinstance(kv_pages, LayerPages):
        view, kv_pages = kv_pages, kv_pages.pages
        offset = pallas_kernels.stacked_page_offset(kv_pages, view.layer, view.num_layers)
    resolved = pallas_kernels.resolve_backend(backend)
    writer = resolved if resolved in ("pallas-tpu", "pallas-tpu-interpret") else "xla"  # scales kept in TPU HBM
    kv_pages = pallas_kernels.write_kv(kv_pages, k, v, meta.slot_mapping, offset, writer)
    out = pallas_kernels.ragged_paged_attention(
        q,
        kv_pages,
        meta.kv_lens,
        meta.block_tables,
        meta.cu_q_lens,
        meta.num_seqs,
        offset,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        backend=backend,
    )
    return out, kv_pages if view is None else view.replace(pages=kv_pages)


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from `lo` up to the first one >= `hi`."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out


def bucket_for(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True, slots=True)
class LoraShape:
    """The LoRA device arrays' static shape: `max_loras` slots (1..max_loras; slot 0, none, has no arrays) of rank
    `max_rank`."""

    max_loras: int
    max_rank: int


@functools.cache
def step_functions(
    config: ModelConfig,
    backend: str,
    mesh: jax.sharding.Mesh | None = None,
    quantized_kv: bool = False,
    weights: tuple[str, bool, bool] | None = None,
    lora: LoraShape | None = None,
    onednn: bool = False,
    scan: bool = False,
    stacked_order: StackedOrder = (),
):
    """The model and its jitted forward step, shared by every runner with the same config, backend and
    mesh (so engines in one process share compilations).

    forward(params, kv_caches, token_ids [T], positions [T], meta, logits_indices [S], lora)
        -> (logits [S, V] f32, kv_caches, hidden [T, H] after the final norm), with kv_caches donated; `lora` a
        `LoraBatch`, or None when off. `onednn`: the step is compiled with oneDNN dots
        (`paged_jax.worker.xla_flags`), so the LM head returns its logits rounded to the model's dtype (the
        form oneDNN's dot takes) before they are widened to float32. `scan`: the scanned decoder; kv_caches is
        then the one stacked cache and params the stacked tree (`paged_jax.model.scan`), else a tuple of
        per-layer caches; `stacked_order`: the stacked weights' axis order (`paged_jax.model.scan.stacked_order`).
    With a mesh, attention runs per TP shard (`shard_map`) and the operands are pinned to the mesh:
    params by their partition specs, KV pages by KV heads, metadata and logits replicated, LoRA arrays
    like their base weights (`paged_jax.lora.weights`).
    """
    attn = partial(paged_attention, backend=backend, sliding_window=config.sliding_window)
    if mesh is not None:
        attn = sharding.shard_attention(attn, mesh, quantized_kv)
    model = causal_lm(config, attn, mesh, scan_layers=scan, stacked_order=stacked_order)

    def forward(
        params, kv_caches, token_ids, positions, meta: PagedMeta, logits_indices, lora: LoraBatch | None = None
    ):
        hidden, kv_caches = model.apply(params, token_ids, positions, kv_caches, meta, lora)
        logits = model.apply(params, hidden[logits_indices], round_to_dtype=onednn, method="compute_logits")
        return logits, kv_caches if scan else tuple(kv_caches), hidden

    if mesh is None:
        return model, jax.jit(forward, donate_argnums=(1,))
    shardings = sharding.step_shardings(config, mesh, quantized_kv, weights, scan, stacked_order)
    rep = sharding.replicated(mesh)
    lora_in = None if lora is None else LoraBatch(_lora_shardings(config, mesh, lora), rep)
    shardings["in_shardings"] = (*shardings["in_shardings"], lora_in)
    return model, jax.jit(forward, donate_argnums=(1,), **shardings)


def _lora_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, lora: LoraShape) -> lora_weights.LoraWeights:
    specs = lora_weights.partition_specs(config, lora.max_loras, lora.max_rank, sharding.TP)
    return jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )


@functools.cache
def _lora_writer(config: ModelConfig, mesh: jax.sharding.Mesh | None, lora: LoraShape):
    """`paged_jax.lora.weights.write_slot` jitted with the arrays donated (kept in their mesh layout)."""
    if mesh is None:
        return jax.jit(lora_weights.write_slot, donate_argnums=(0,))
    return jax.jit(lora_weights.write_slot, donate_argnums=(0,), out_shardings=_lora_shardings(config, mesh, lora))


@functools.cache
def prompt_logprobs_function(
    config: ModelConfig,
    backend: str,
    mesh: jax.sharding.Mesh | None = None,
    quantized_kv: bool = False,
    weights: tuple[str, bool, bool] | None = None,
    scan: bool = False,
    stacked_order: StackedOrder = (),
):
    """The jitted prompt-logprob step (`paged_jax.worker.prompt_logprobs`) of `step_functions`' model."""
    model, _ = step_functions(config, backend, mesh, quantized_kv, weights, scan=scan, stacked_order=stacked_order)
    shardings = None if mesh is None else sharding.logits_shardings(config, mesh, weights, scan, stacked_order)
    return make_prompt_logprobs(model, shardings)


def _scale_layout(platform: str, mesh: jax.sharding.Mesh | None) -> dict:
    """How quantized pages' scale rows are stored on `platform`: lane-dense on TPU, each TP shard's part of a row
    padded on its own (`pallas_kernels.kv_quant.scales_shape`)."""
    return {"dense": kv_quant.lane_dense(platform), "shards": 1 if mesh is None else mesh.shape[sharding.TP]}


def _allocate_kv(
    config: ModelConfig, num_pages: int, page_size: int, kv_dtype, mesh: jax.sharding.Mesh | None, platform: str
):
    """A zeroed cache of `num_pages` pages (one layer's, or all layers' stacked): a page array, or
    `QuantizedPages` (values and scales, `_scale_layout`) for int8 / fp8."""
    device = None if mesh is None else sharding.kv_sharding(mesh)
    if kv_quant.is_quantized_dtype(kv_dtype):
        scales_device = None if mesh is None else sharding.kv_scales_sharding(mesh)
        return kv_quant.allocate(
            num_pages,
            config.num_kv_heads,
            page_size,
            config.head_dim,
            kv_dtype,
            device,
            scales_device,
            **_scale_layout(platform, mesh),
        )
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    return jnp.zeros(shape, kv_dtype, device=device)


def _abstract_kv(
    config: ModelConfig, num_pages: int, page_size: int, kv_dtype, mesh: jax.sharding.Mesh | None, one, platform: str
):
    """One layer's cache as `jax.ShapeDtypeStruct`s (nothing allocated): on `mesh` as `_allocate_kv` places it, or
    on the single-device sharding `one`."""
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    pages = jax.ShapeDtypeStruct(shape, kv_dtype, sharding=one if mesh is None else sharding.kv_sharding(mesh))
    if not kv_quant.is_quantized_dtype(kv_dtype):
        return pages
    scales_on = one if mesh is None else sharding.kv_scales_sharding(mesh)
    scales = kv_quant.scales_shape(num_pages, config.num_kv_heads, page_size, **_scale_layout(platform, mesh))
    return kv_quant.QuantizedPages(pages, jax.ShapeDtypeStruct(scales, jnp.float32, sharding=scales_on))


def _copy_all_pages(kv_caches, src, dst):
    return tuple(pallas_kernels.copy_pages(kv, src, dst) for kv in kv_caches)


@functools.cache
def _copy_pages(num_layers: int, scan: bool, mesh: jax.sharding.Mesh | None = None, quantized_kv: bool = False):
    """Copy-on-write of pages on every layer (per-layer caches, or the stacked one with `scan`), jitted with the
    caches donated and, with a mesh, kept in their mesh layout (so donation stays in place)."""
    copy = partial(pallas_kernels.copy_stacked_pages, num_layers=num_layers) if scan else _copy_all_pages
    if mesh is None:
        return jax.jit(copy, donate_argnums=(0,))
    kv = sharding.kv_cache_sharding(mesh, quantized_kv)
    return jax.jit(copy, donate_argnums=(0,), out_shardings=kv if scan else (kv,) * num_layers)


@partial(jax.jit, static_argnames=("width", "do_sample", "do_filter", "do_penalty", "want_logprobs"))
def _sample_rows(
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
    tokens = out.tokens if verify is None else mask_rejected(out.tokens, verify.next_draft, verify.row_start)
    return out._replace(tokens=jnp.pad(tokens, (0, width - tokens.shape[0])))


def _drop_axis(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


GREEDY = SamplerFlags(False, False, False, False)


class _Forward(NamedTuple):
    """A dispatched forward step: its logits [S, V] and hidden states [T, H] on device, its buckets."""

    logits: jax.Array
    hidden: jax.Array
    s: int
    t: int


EXECUTABLES = Executables()  # every runner's compiled step shapes, shared within the process


class Job(NamedTuple):
    """One executable to compile: its cache key, how to lower it (argument specs built only then), and its
    shape in words for the log."""

    key: Hashable
    lower: Callable[[], jax.stages.Lowered]
    describe: str
    options: CompilerOptions = ()  # XLA compiler options (`paged_jax.worker.xla_flags`); part of `key` too


def _resolved_backend(backend: str, platform: str) -> str:
    """The attention backend `backend` means on `platform`, naming the CPU kernel's library when it is that
    (building and registering it: a stored executable calling it loads only once it is registered)."""
    try:
        resolved = pallas_kernels.resolve_backend(backend, platform)
    except ValueError:
        return backend  # the step's own trace raises the error that names it
    if resolved == "cpu":
        kernel = cpu_paged.kernel()
        return f"cpu:{kernel.library.name}" if kernel is not None else "cpu:unavailable"
    return resolved


def _fingerprint(tree) -> str:
    """Shapes, dtypes and shardings of a pytree's leaves: part of an executable's key."""
    leaves = [(x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(tree)]
    return hashlib.sha1(repr((jax.tree.structure(tree), leaves)).encode()).hexdigest()


@dataclass(slots=True)
class ForwardLaunched:
    """A forward step on the device whose sampling is not dispatched yet (`ModelRunner.launch_sample`)."""

    logits: jax.Array  # [S, V] f32, on device
    meta: SamplingMeta  # the sampler's inputs (history merged)
    flags: SamplerFlags
    s: int  # the sequence bucket
    verify: VerifyRows | None  # speculation: where each sequence's rows start and its next draft
    prompt_logprobs: PromptLogprobs | None = None  # on device, when the step has prompt-logprob positions


@dataclass(slots=True)
class StepResult:
    """Host copies of one step's samples; row r belongs to `SchedulerOutput.sample_rows[r]`."""

    tokens: np.ndarray  # [R] i32
    logprob: np.ndarray  # [R] f32
    top_ids: np.ndarray  # [R, K] i32
    top_logprobs: np.ndarray  # [R, K] f32
    prompt_logprobs: PromptLogprobs | None = None  # numpy, [P] rows: the step's prompt-logprob positions in order

    def logprobs_of(self, row: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """Row `row`'s token logprob and its `k` most likely (id, logprob) alternatives."""
        top = [(int(i), float(v)) for i, v in zip(self.top_ids[row, :k], self.top_logprobs[row, :k], strict=True)]
        return float(self.logprob[row]), top


class ModelRunner:
    """Owns the parameters, the KV page arrays and the compiled step functions.

    `mesh`: None for the default device; otherwise `params` must already be placed on it
    (`sharding.shard_params`, which also gives the `config` to pass here) and the pages are created on it.
    `num_speculative_tokens` > 0: steps may verify that many drafts per sequence (`paged_jax.spec`): the sequence
    buckets then reach the sample rows of a full verify step, and the sampler marks the rejected rows.
    `scan_layers` ("auto" | "on" | "off", `paged_jax.model.scan.use_scan`): the scanned decoder, whose weights
    the runner stacks once and whose KV cache is one stacked array (`self.scan` says which was chosen).
    `abstract`: `params` are `jax.ShapeDtypeStruct`s (placed on `mesh`, or all on one device) and nothing is
    allocated, no KV pages, no LoRA slots: the runner's jobs lower and compile exactly as the engine's, for
    a target this process cannot run on (`paged_jax.worker.aot`: deviceless TPU and GPU topologies); it cannot
    run a step.
    `executable_store`: a directory of serialized executables (`paged_jax.worker.executable_store`) that
    compiling looks in first and writes to; None: off (an abstract runner never uses one).
    """

    def __init__(
        self,
        config: ModelConfig,
        params,
        *,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        attention_backend: str = "auto",
        kv_dtype: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        max_logit_bias: int = MAX_LOGIT_BIAS,
        lora: LoraShape | None = None,
        num_speculative_tokens: int = 0,
        scan_layers: str = "auto",
        abstract: bool = False,
        executable_store: str | None = None,
    ) -> None:
        self.config = config
        self.abstract = abstract
        self.lora = lora
        # The platform the steps compile for: the mesh's, an abstract runner's target device's, else this process's.
        if mesh is not None:
            platform = mesh.devices.flat[0].platform
        elif abstract:
            platform = next(iter(jax.tree.leaves(params)[0].sharding.device_set)).platform
        else:
            platform = jax.devices()[0].platform
        # The scanned decoder (paged_jax.model.scan).
        self.scan = use_scan(scan_layers)
        self.stacked_order = stacked_order(platform) if self.scan else ()  # the stacked weights' axis order
        self.params = self._stack(params, mesh, abstract) if self.scan else params
        params = self.params
        self.mesh = mesh
        self.page_size = page_size
        self.max_blocks = cdiv(max_model_len, page_size)
        self.max_num_seqs = max_num_seqs
        self.token_buckets = pow2_buckets(16, max_num_batched_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        max_rows = min(max_num_batched_tokens, max_num_seqs * (1 + num_speculative_tokens))
        self.seq_buckets = pow2_buckets(8, max(max_num_seqs, max_rows))
        # Copy-on-write instructions of one step: at most one per running sequence (a fork's child copies the
        # shared last page once), so these buckets are every copy shape a run can reach; more are chunked.
        self.copy_buckets = pow2_buckets(8, max_num_seqs)
        # Sampling arrays whose size a request chooses have one fixed width each, compiled at warm-up: the ban
        # list (EOS + stop ids under min_tokens) and the penalties' token history (prompt + output).
        self.suppress_width = pow2_buckets(8, MAX_STOP_TOKEN_IDS + len(config.eos_token_ids))[-1]
        self.history_len = pow2_buckets(64, max_model_len)[-1]
        self.logit_bias_width = (
            max_logit_bias  # bias columns of a step with a biased row (`paged_jax.worker.logit_bias`)
        )
        self.kv_dtype = quant.kv_cache_dtype(kv_dtype, config.dtype)
        self.num_pages = num_pages  # per layer
        # Where a one-device runner's operands live: the default device, or an abstract runner's target device.
        one = jax.tree.leaves(params)[0].sharding if abstract and mesh is None else None
        pages = num_pages * config.num_layers if self.scan else num_pages  # the scanned decoder: one stacked cache
        if abstract:
            layer = _abstract_kv(config, pages, page_size, self.kv_dtype, mesh, one, platform)
            self.kv_caches = layer if self.scan else (layer,) * config.num_layers
        elif self.scan:
            self.kv_caches = _allocate_kv(config, pages, page_size, self.kv_dtype, mesh, platform)
        else:
            self.kv_caches = tuple(
                _allocate_kv(config, num_pages, page_size, self.kv_dtype, mesh, platform)
                for _ in range(config.num_layers)
            )
        # Lowering sees only these (a background compile never touches pages a running step donated).
        self._kv_specs = jax.tree.map(
            lambda kv: jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=kv.sharding), self.kv_caches
        )
        self._rep = one if mesh is None else sharding.replicated(mesh)
        quantized_kv = kv_quant.is_quantized_dtype(self.kv_dtype)
        # Float weights only: an int8/fp8 weight's bf16 x bf16 -> f32 dot would be widened to f32 (3x slower).
        onednn = xla_flags.use_onednn_dots(config.dtype, platform) and quant.weights_key(params) is None
        # A scanned GPU step with float weights: cuBLAS dots, which read each layer's weight slice in place.
        self._scanned_gpu = self.scan and platform == "gpu" and quant.weights_key(params) is None
        weights = quant.weights_key(params)
        self.model, self._forward = step_functions(
            config, attention_backend, mesh, quantized_kv, weights, lora, False, self.scan, self.stacked_order
        )
        # The forward step of token buckets >= ONEDNN_MIN_TOKENS with oneDNN dots (its LM head rounded), or None.
        self._forward_onednn = None
        if onednn:
            _, self._forward_onednn = step_functions(
                config, attention_backend, mesh, quantized_kv, weights, lora, True, self.scan, self.stacked_order
            )
            mode = xla_flags.onednn_mode()
            log.info(
                "%s forward steps of >= %d tokens compiled with oneDNN dots (%s=%s)",
                jnp.dtype(config.dtype).name,
                xla_flags.ONEDNN_MIN_TOKENS,
                xla_flags.ONEDNN_ENV,
                mode,
            )
        self._prompt_logprobs = prompt_logprobs_function(
            config, attention_backend, mesh, quantized_kv, quant.weights_key(params), self.scan, self.stacked_order
        )
        self.lora_weights = None  # the adapters' device slots (paged_jax.lora.weights), when LoRA is on
        if lora is not None:
            shardings = None if mesh is None else _lora_shardings(config, mesh, lora)
            if abstract:
                shapes = lora_weights.abstract_weights(config, lora.max_loras, lora.max_rank)
                on = shardings or jax.tree.map(lambda _: one, shapes)
                self.lora_weights = jax.tree.map(
                    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, on
                )
            else:
                self.lora_weights = lora_weights.allocate(config, lora.max_loras, lora.max_rank, shardings)
            self._lora_write = _lora_writer(config, mesh, lora)
        # The merge input when there is no lookahead.
        self._no_prev_tokens = (
            self._spec(self.seq_buckets[-1])
            if abstract
            else jnp.zeros(self.seq_buckets[-1], jnp.int32, device=self._rep)
        )
        self._allow_all: dict[int, jax.Array] = {}  # the sampler's bitmask when no row is constrained, per S
        self._copy = _copy_pages(config.num_layers, self.scan, mesh, quantized_kv)
        # What makes two runners' executables interchangeable, as plain values (the executable store keys its
        # entries by their repr in another process): what `step_functions`, `prompt_logprobs_function`,
        # `_copy_pages` and `_lora_writer` are built from (the same values give the same functions), the
        # attention backend this platform resolves it to (with the CPU kernel's library: its ISA path and
        # sources), and the parameters' and pages' avals.
        self._key = (
            config,
            attention_backend,
            _resolved_backend(attention_backend, platform),
            mesh,
            quantized_kv,
            weights,
            onednn,
            self.scan,
            self.max_blocks,
            self.seq_buckets[-1],  # the width of the sampler's padded ids and of the lookahead's merge input
            _fingerprint(params),
            _fingerprint(self._kv_specs),
            lora,
        )
        self.store = None if abstract or not executable_store else open_store(executable_store)
        self.device_seconds = 0.0  # time blocked waiting for the device (host idle)
        self.compile_stats = CompileStats()
        self.warm = False  # warm-up is over: a compile now stalls a step and is logged (`Executables.get`)
        self.deferred = False  # the warm-up left shapes to their first use: such a compile is no warning
        self.show_compiles = False  # a step waiting for a compile shows a progress bar on stderr (Python API)
        self.real_tokens = 0  # tokens of scheduled work, summed over steps
        self.padded_tokens = 0  # padding tokens added to reach the token bucket, summed over steps

    def _stack(self, params, mesh: jax.sharding.Mesh | None, abstract: bool = False):
        """The stacked tree of `params` (`paged_jax.model.scan.stack_layers`), placed like the step takes it;
        abstract params give the stacked tree's `jax.ShapeDtypeStruct`s."""
        stack = partial(stack_layers, order=self.stacked_order)
        shapes = jax.eval_shape(stack, params)
        if mesh is None:
            if abstract:
                one = jax.tree.leaves(params)[0].sharding
                return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), shapes)
            return jax.jit(stack)(params)
        shardings = sharding.param_shardings(self.config, mesh, shapes, self.stacked_order)
        if abstract:
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)
        return jax.jit(stack, out_shardings=shardings)(params)

    def layer_cache(self, layer: int):
        """Layer `layer`'s KV cache (pages, or `QuantizedPages`) as one layer's array: a copy when scanned (for
        tests and inspection; the step never slices)."""
        if not self.scan:
            return self.kv_caches[layer]
        p = self.num_pages
        return jax.tree.map(lambda x: x[layer * p : (layer + 1) * p], self.kv_caches)

    # -- host side ----------------------------------------------------------------------------------
    def copy_pages(self, ops: list[PageCopy]) -> None:
        """Run the KV manager's copy-on-write instructions on every layer, in place."""
        top = self.copy_buckets[-1]
        for start in range(0, len(ops), top):  # copies are independent: chunks of the largest compiled bucket
            chunk = ops[start : start + top]
            n = bucket_for(len(chunk), self.copy_buckets)
            src = np.zeros(n, np.int32)  # padding copies the null page onto itself
            dst = np.zeros(n, np.int32)
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk, strict=True)
            self.kv_caches = self._executable(self.copy_job(n))(self.kv_caches, src, dst)

    def load_lora(self, load: SlotLoad) -> None:
        """Write an adapter into its device slot, in place (the same executable for every slot and adapter)."""
        arrays, scaling = lora_weights.slot_arrays(load.adapter, self.config, self.lora.max_rank)
        write = self._executable(self.lora_write_job())
        self.lora_weights = write(self.lora_weights, np.int32(load.slot), arrays, scaling)

    def seq_bucket(self, t: int, rows: int = 0) -> int:
        """The sequence bucket of a step of token bucket `t` with `rows` sequences or sample rows (see the module
        docstring): `bucket(min(t, max_num_seqs))`, or more when `rows` exceeds that."""
        return bucket_for(max(min(t, self.max_num_seqs), rows), self.seq_buckets)

    def step_seq_buckets(self, t: int, forks: bool = False) -> list[int]:
        """The sequence buckets a step of token bucket `t` can use (warm-up compiles each): `seq_bucket(t)`, and
        with speculation those up to one holding the sample rows of a full verify step (each row is a token).

        `forks`: requests with n > 1 can run. A prompt's last chunk then samples one row per child sequence, so
        a step of few tokens can have up to `max_num_seqs` sample rows (4 prompts x n=16 in 32 tokens: 64)."""
        lo = self.seq_bucket(t)
        rows = min(t, self.max_num_seqs * (1 + self.num_speculative_tokens))
        if forks:
            rows = max(rows, self.max_num_seqs)
        hi = self.seq_bucket(t, rows)
        return [s for s in self.seq_buckets if lo <= s <= hi]

    def launch(
        self, sched: SchedulerOutput, prev_samples: SamplerOutput | None = None, bitmask: np.ndarray | None = None
    ) -> SamplerOutput:
        """Dispatch one step (copies, forward, sampling) without waiting; returns the samples on device.

        `prev_samples`: the previous step's samples, still on the device, for tokens scheduled before their
        ids reached the host (the engine's one-step lookahead); they are merged in on the device. `bitmask`:
        the structured-output rows' allowed tokens (see `launch_sample`).
        """
        return self.launch_sample(self.launch_forward(sched, prev_samples), bitmask)

    def launch_forward(self, sched: SchedulerOutput, prev_samples: SamplerOutput | None = None) -> ForwardLaunched:
        """The first half of `launch`: copies and the forward step, dispatched without waiting. The engine fills
        structured-output masks on the host while the device runs it, then calls `launch_sample`."""
        fwd = self._forward_step(sched, prev_samples)
        s = fwd.s
        sampling = build_sampling_inputs(
            sched.sample_rows,
            s,
            self.suppress_width,
            self.history_len,
            self.config.eos_token_ids,
            self.logit_bias_width,
        )
        verify = verify_rows(sched, s) if self.num_speculative_tokens else None
        prompt = None
        rows = build_prompt_rows(sched, fwd.t)
        if rows is not None:
            job = self.prompt_logprobs_job(fwd.t)
            prompt = self._executable(job)(self.params, fwd.hidden, rows.rows, rows.targets, rows.num_rows)
        m = self._with_history(sampling, prev_samples)
        return ForwardLaunched(fwd.logits, m, sampling.flags, s, verify, prompt)

    def launch_greedy(self, sched: SchedulerOutput) -> jax.Array:
        """One step of `sched` taking each sample row's argmax whatever its sequence's sampling parameters (a draft
        model's proposals, `paged_jax.spec.draft_model`); returns the ids on device ([seq_buckets[-1]] i32)."""
        fwd = self._forward_step(sched, None)
        s = fwd.s
        meta = SamplingMeta(**empty_meta(s, self.suppress_width))
        job = self.sample_job(s, self.suppress_width, 1, GREEDY)
        return self._executable(job)(fwd.logits, meta, self._bitmask(s, None), None).tokens

    def _forward_step(self, sched: SchedulerOutput, prev_samples: SamplerOutput | None) -> _Forward:
        """Copies, adapter loads and the forward step of `sched`, dispatched without waiting."""
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner has no KV pages: it compiles steps, it cannot run one")
        if sched.copy_ops:
            self.copy_pages(sched.copy_ops)
        for load in sched.lora_loads:
            self.load_lora(load)
        t = bucket_for(sched.num_tokens, self.token_buckets)
        s = self.seq_bucket(t, max(len(sched.scheduled), len(sched.sample_rows)))
        step = build_step_inputs(sched, t, s, self.page_size, self.max_blocks)
        self.real_tokens += sched.num_tokens
        self.padded_tokens += t - sched.num_tokens
        token_ids = step.token_ids
        if step.has_pending:
            token_ids = self._executable(self.merge_job(t))(token_ids, step.prev_rows, prev_samples.tokens)
        meta = PagedMeta(step.slot_mapping, step.kv_lens, step.block_tables, step.cu_q_lens, step.num_seqs)
        forward = self._executable(self.forward_job(t, s))
        lora = None if self.lora is None else LoraBatch(self.lora_weights, step.lora_slots)
        logits, self.kv_caches, hidden = forward(
            self.params, self.kv_caches, token_ids, step.positions, meta, step.logits_indices, lora
        )
        return _Forward(logits, hidden, s, t)

    def launch_sample(self, fwd: ForwardLaunched, bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Dispatch the sampling of a launched forward step. `bitmask`: int32 [R, ceil(V / 32)] for the step's
        first R sample rows (`paged_jax.structured.bitmask`), None when no row is constrained (a device-resident
        all-ones mask is used: nothing crosses to the device)."""
        m = fwd.meta
        job = self.sample_job(fwd.s, m.suppress.shape[1], m.history.shape[1], fwd.flags, m.logit_bias.shape[1])
        return self._executable(job)(fwd.logits, m, self._bitmask(fwd.s, bitmask), fwd.verify)

    def _bitmask(self, s: int, bitmask: np.ndarray | None) -> jax.Array | np.ndarray:
        """The sampler's bitmask operand for `s` rows: `bitmask` padded with all-ones rows, or the cached
        device all-ones mask."""
        if bitmask is None:
            if s not in self._allow_all:
                # device_put, not jnp.asarray: JAX 0.11 lifts a numpy array with a `jit(stage)` executable
                # compiled per new shape, and this one first appears after warm-up
                self._allow_all[s] = jax.device_put(all_allowed(s, self.config.vocab_size), self._rep)
            return self._allow_all[s]
        if bitmask.shape[0] == s:
            return bitmask
        full = all_allowed(s, self.config.vocab_size)
        full[: bitmask.shape[0]] = bitmask
        return full

    def _with_history(self, sampling: SamplingInputs, prev_samples: SamplerOutput | None) -> SamplingMeta:
        """The sampling meta, with a penalized step's history always made on the device by one merge (the
        lookahead's pending tokens, if any), so the sampler sees one kind of array: one compiled variant."""
        m = sampling.meta
        if not sampling.flags.do_penalty:
            return m
        prev = prev_samples.tokens if prev_samples is not None else self._no_prev_tokens
        history = self._executable(self.history_job(len(sampling.pending_rows)))(
            m.history, sampling.pending_rows, sampling.pending_cols, prev
        )
        return m._replace(history=history)

    def collect(
        self,
        out: SamplerOutput,
        num_rows: int,
        prompt_logprobs: PromptLogprobs | None = None,
        num_prompt_rows: int = 0,
    ) -> StepResult:
        """Wait for a launched step and copy its first `num_rows` samples (and `num_prompt_rows` prompt-logprob
        rows) to the host."""
        t0 = time.perf_counter()
        host, prompt = jax.device_get((out, prompt_logprobs))
        self.device_seconds += time.perf_counter() - t0
        r = num_rows
        if prompt is not None:
            prompt = PromptLogprobs(*(a[:num_prompt_rows] for a in prompt))
        return StepResult(host.tokens[:r], host.logprob[:r], host.top_ids[:r], host.top_logprobs[:r], prompt)

    # -- executables --------------------------------------------------------------------------------
    def _executable(self, job: Job) -> jax.stages.Compiled:
        return EXECUTABLES.get(
            job.key,
            job.lower,
            self.compile_stats,
            warm=self.warm,
            describe=job.describe,
            options=job.options,
            store=self.store,
            deferred=self.deferred,
            show=self.show_compiles,
        )

    def _spec(self, *shape: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._rep)

    def forward_job(self, t: int, s: int) -> Job:
        """The forward step of `t` tokens and `s` sequences (with oneDNN dots from ONEDNN_MIN_TOKENS tokens on,
        when the runner uses them: `paged_jax.worker.xla_flags`)."""

        def lower() -> jax.stages.Lowered:
            i32 = self._spec
            meta = PagedMeta(i32(t), i32(s), i32(s, self.max_blocks), i32(s + 1), i32(1))
            lora = None if self.lora is None else LoraBatch(self._lora_specs(), i32(t))
            return forward.lower(self.params, self._kv_specs, i32(t), i32(t), meta, i32(s), lora)

        onednn = self._forward_onednn is not None and t >= xla_flags.ONEDNN_MIN_TOKENS
        forward = self._forward_onednn if onednn else self._forward
        options = xla_flags.forward_compiler_options(onednn, self._scanned_gpu)
        return Job(("forward", self._key, t, s, options), lower, f"forward tokens={t} seqs={s}", options)

    def sample_job(
        self, s: int, suppress_width: int, history_len: int, flags: SamplerFlags, logit_bias_width: int = 0
    ) -> Job:
        """Sampling of `s` rows with the given static flags (do_sample, do_filter, do_penalty, want_logprobs)
        and bias columns. The argument specs are built only when the executable is compiled (this runs every
        step)."""
        verify = self.num_speculative_tokens > 0

        def lower() -> jax.stages.Lowered:
            shapes = {k: v.shape for k, v in empty_meta(s, suppress_width, history_len, logit_bias_width).items()}
            dtypes = {k: v.dtype for k, v in empty_meta(1).items()}
            meta = SamplingMeta(**{k: self._spec(*shapes[k], dtype=dtypes[k]) for k in shapes})
            logits = self._spec(s, self.config.vocab_size, dtype=jnp.float32)
            bitmask = self._spec(s, mask_words(self.config.vocab_size))
            width = self.seq_buckets[-1]
            rows = VerifyRows(self._spec(s), self._spec(s)) if verify else None
            return _sample_rows.lower(logits, meta, bitmask, rows, width=width, **SamplerFlags(*flags)._asdict())

        return Job(
            ("sample", self._key, s, suppress_width, history_len, flags, self.seq_buckets[-1], verify)
            + (logit_bias_width,),
            lower,
            f"sample rows={s} suppress={suppress_width} history={history_len} logit_bias={logit_bias_width} "
            + (" ".join(n for n, on in SamplerFlags(*flags)._asdict().items() if on) or "greedy"),
        )

    def prompt_logprobs_job(self, t: int) -> Job:
        """Prompt logprobs of up to `t` rows of a `t`-token step (`paged_jax.worker.prompt_logprobs`)."""

        def lower() -> jax.stages.Lowered:
            hidden = self._spec(t, self.config.hidden_size, dtype=jnp.dtype(self.config.dtype))
            i32 = self._spec
            return self._prompt_logprobs.lower(self.params, hidden, i32(t), i32(t), i32(1))

        return Job(("prompt_logprobs", self._key, t), lower, f"prompt logprobs tokens={t}")

    def merge_job(self, t: int) -> Job:
        """The lookahead's merge of the previous step's ids (always `seq_buckets[-1]` rows) into `t` tokens."""
        i32 = self._spec
        return Job(
            ("merge", self._key, t, self.seq_buckets[-1]),
            lambda: merge_pending.lower(i32(t), i32(t), i32(self.seq_buckets[-1])),
            f"merge tokens={t}",
        )

    def history_job(self, s: int) -> Job:
        """The lookahead's merge of the previous step's ids into `s` rows of penalty history."""
        i32 = self._spec
        return Job(
            ("history", self._key, s, self.seq_buckets[-1]),
            lambda: merge_pending_history.lower(i32(s, self.history_len), i32(s), i32(s), i32(self.seq_buckets[-1])),
            f"history rows={s} length={self.history_len}",
        )

    def _lora_specs(self) -> lora_weights.LoraWeights:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.lora_weights)

    def lora_write_job(self) -> Job:
        """Writing one adapter into one LoRA slot (the slot a traced scalar: one executable for all)."""

        def lower() -> jax.stages.Lowered:
            one = lora_weights.abstract_weights(self.config, 1, self.lora.max_rank)
            arrays = {
                k: self._spec(*_drop_axis(x.shape, lora_weights.slot_axis(k, x.ndim)), dtype=x.dtype)
                for k, x in one.arrays.items()
            }
            scaling = self._spec(dtype=jnp.float32)
            return self._lora_write.lower(self._lora_specs(), self._spec(), arrays, scaling)

        return Job(("lora_write", self._key), lower, "lora slot write")

    def copy_job(self, n: int) -> Job:
        """Copy-on-write of `n` pages on every layer."""
        return Job(
            ("copy", self._key, n),
            lambda: self._copy.lower(self._kv_specs, self._spec(n), self._spec(n)),
            f"copy pages={n}",
        )

    def compile(self, jobs: list[Job], workers: int, progress=None, cancel=None) -> int:
        """Compile `jobs` on `workers` threads (skipping those already compiled); returns how many were new.
        `cancel` (a threading.Event): stop starting compiles once set."""
        return len(
            EXECUTABLES.compile_all(
                ((job.key, job.lower, job.options) for job in jobs),
                self.compile_stats,
                workers,
                progress,
                cancel,
                self.store,
            )
        )

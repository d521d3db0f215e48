"""Where does a step run? The runner owns the parameters, the KV page arrays and the compiled steps, and runs
one step from the scheduler's output.

Each step's inputs are numpy arrays padded to a token bucket `T` and a sequence bucket `S`
(`paged_jax.worker.buckets`), built from the scheduler's output by `paged_jax.worker.step_inputs` (the runner never
reads the KV manager: the scheduler's output carries each sequence's page ids); the forward pass returns logits
only for the rows that sample (and its final hidden states, from which a step with prompt-logprob positions
computes theirs, `paged_jax.worker.prompt_logprobs`); sampling is a second jitted call on device; the host receives
only the sampled ids (and requested logprobs). The sampler's output ids are padded to the largest `S`, so the
lookahead's on-device merge of the previous step's ids is one executable per `T`.

The pieces: the attention seam (`paged_attention`), the jitted functions (`step_functions`, one set per
`StepKey`), the page arrays (`kv_allocation`), the executables' jobs (`compile_jobs`). Executables are compiled
ahead of time (`paged_jax.worker.executables`): warm-up compiles the shapes a run can reach on a thread pool
(`paged_jax.worker.warmup` says which); a shape first needed after warm-up is compiled then, counted, and logged
as a warning with its shape.

A scanned decoder (`paged_jax.model.scan`, the default where the model allows it) keeps all layers' pages in one
stacked array and its parameters stacked on a leading layer axis (`stack_layers`, once, here). With a device mesh
(tensor parallelism, or a data-parallel replica on devices other than the default) the same step runs with its
operands pinned to the mesh; see `paged_jax.worker.sharding` for the layout.

With LoRA on (`LoraShape`), the runner owns the adapters' device arrays (`paged_jax.lora.weights`: stacked for
the scanned decoder, one set per layer for the unrolled one): the scheduler's `lora_loads` are written into their
slots before the step (one executable for every slot), and the forward step takes the arrays and each token's
slot id; its shapes do not depend on which adapters run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import LINEAR_ATTENTION_TYPES, ConfigError, ModelConfig
from paged_jax.kv_cache import HostTier, KVGroup, KVLayout, PageCopy, StateCopy
from paged_jax.lora import weights as lora_weights
from paged_jax.lora.delta import LoraBatch
from paged_jax.lora.registry import SlotLoad
from paged_jax.model import cpu_weights, quant
from paged_jax.model.scan import stack_layers, stacked_order, use_scan
from paged_jax.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from paged_jax.sched.output import SchedulerOutput
from paged_jax.structured.bitmask import all_allowed
from paged_jax.worker import sharding, xla_flags
from paged_jax.worker.buckets import StepBuckets, bucket_for, pow2_buckets
from paged_jax.worker.compile_jobs import CompileJobs, Job, RunnerKey, fingerprint, resolved_backend
from paged_jax.worker.executable_store import open_store
from paged_jax.worker.executables import CompileStats, Executables
from paged_jax.worker.kv_allocation import abstract_kv, allocate_kv
from paged_jax.worker.kv_transfer import KVTransfer
from paged_jax.worker.linear_state import (
    abstract_state,
    allocate_state,
    build_state_meta,
    copy_states_function,
    linear_backend,
)
from paged_jax.worker.paged_attention import GroupedPages, PagedMeta
from paged_jax.worker.pooling import build_pool_rows
from paged_jax.worker.prompt_logprobs import PromptLogprobs, build_prompt_rows
from paged_jax.worker.ready_shapes import ReadyShapes, request_flags, union
from paged_jax.worker.sampler import SamplerOutput, SamplingMeta, empty_meta
from paged_jax.worker.spec_verify import VerifyRows, verify_rows
from paged_jax.worker.step_functions import (
    GREEDY,
    LoraShape,
    StepKey,
    copy_pages_function,
    lora_shardings,
    lora_writer,
    prompt_logprobs_function,
    step_functions,
)
from paged_jax.worker.step_inputs import SamplerFlags, SamplingInputs, build_sampling_inputs, build_step_inputs
from paged_jax.worker.step_plan import CopyChunk, StepPlan
from pallas_kernels import kv_quant

log = logging.getLogger(__name__)

EXECUTABLES = Executables()  # every runner's compiled step shapes, shared within the process


class _Forward(NamedTuple):
    """A dispatched forward step: its logits [S, V] and hidden states [T, H] on device, its buckets, and the
    compiled sampler variant it resolved to (None: the rows' own, `resolve_shapes` off or nothing compiled)."""

    logits: jax.Array
    hidden: jax.Array
    s: int
    t: int
    flags: SamplerFlags | None = None


@dataclass(slots=True)
class ForwardLaunched:
    """A forward step on the device whose sampling is not dispatched yet (`ModelRunner.launch_sample`)."""

    logits: jax.Array  # [S, V] f32, on device
    meta: SamplingMeta  # the sampler's inputs (history merged)
    flags: SamplerFlags
    s: int  # the sequence bucket
    verify: VerifyRows | None  # speculation: where each sequence's rows start and its next draft
    prompt_logprobs: PromptLogprobs | None = None  # on device, when the step has prompt-logprob positions
    pooled: jax.Array | None = None  # [S, H] f32 on device: each pooled sequence's sum (`paged_jax.worker.pooling`)
    plan: StepPlan | None = None  # the host inputs it ran from


@dataclass(slots=True)
class StepResult:
    """Host copies of one step's samples; row r belongs to `SchedulerOutput.sample_rows[r]`."""

    tokens: np.ndarray  # [R] i32
    logprob: np.ndarray  # [R] f32
    top_ids: np.ndarray  # [R, K] i32
    top_logprobs: np.ndarray  # [R, K] f32
    prompt_logprobs: PromptLogprobs | None = None  # numpy, [P] rows: the step's prompt-logprob positions in order
    pooled: np.ndarray | None = None  # [S, H] f32: the step's pooled sums, one row per pooled sequence in order

    def logprobs_of(self, row: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """Row `row`'s token logprob and its `k` most likely (id, logprob) alternatives."""
        top = [(int(i), float(v)) for i, v in zip(self.top_ids[row, :k], self.top_logprobs[row, :k], strict=True)]
        return float(self.logprob[row]), top


def _check_linear_hybrid(
    config: ModelConfig, mesh: jax.sharding.Mesh | None, scan_layers: str, kv_layout: KVLayout | None
) -> None:
    """What a linear-attention hybrid's runner does not support, refused by the field that asks for it."""
    name = config.model_type
    if mesh is not None:
        raise ConfigError(f"tensor_parallel_size: {name!r} runs on one device (its state pool is not sharded yet)")
    if scan_layers == "on":
        raise ConfigError(f"scan_layers: {name!r}'s linear and full-attention layers differ, so it runs unrolled")
    if kv_layout is not None and len(kv_layout.groups) > 1:
        raise ConfigError(f"hybrid_kv: {name!r} has no sliding-window layers to group")


class ModelRunner:
    """Owns the parameters, the KV page arrays and the compiled step functions.

    `mesh`: None for the default device; otherwise `params` must already be placed on it
    (`sharding.shard_params`, which also gives the `config` to pass here) and the pages are created on it.
    `num_speculative_tokens` > 0: steps may verify that many drafts per sequence (`paged_jax.spec_decode`): the
    sequence buckets then reach the sample rows of a full verify step, and the sampler marks the rejected rows.
    `scan_layers` ("auto" | "on" | "off", `paged_jax.model.scan.use_scan`): the scanned decoder, whose weights
    the runner stacks once and whose KV cache is one stacked array (`self.scan` says which was chosen).
    `abstract`: `params` are `jax.ShapeDtypeStruct`s (placed on `mesh`, or all on one device) and nothing is
    allocated, no KV pages, no LoRA slots: the runner's jobs lower and compile exactly as the engine's, for
    a target this process cannot run on (`paged_jax.engine.aot`: deviceless TPU and GPU topologies); it cannot
    run a step.
    `kv_layout`: the KV cache groups (`paged_jax.kv_cache.groups.kv_layout`, the engine's KV manager's): a page is
    `slots_per_page` layer slabs and each group's layers read their own block table; several groups need the
    scanned decoder. None: one group, every layer's slab in every page.
    `num_state_snapshots`: a linear-attention hybrid's snapshot rows after its `max_num_seqs` + 1 state slots
    (`paged_jax.kv_cache.state_snapshots`); with speculation `max_num_seqs` checkpoint rows follow them.
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
        kv_layout: KVLayout | None = None,
        num_state_snapshots: int = 0,
    ) -> None:
        self.linear = config.model_type in LINEAR_ATTENTION_TYPES  # linear layers keep a recurrent-state pool
        if self.linear:
            _check_linear_hybrid(config, mesh, scan_layers, kv_layout)
        # rows of each linear layer's state arrays: the slots (`paged_jax.kv_cache.state_pool`), the snapshots, then
        # with speculation one checkpoint row per slot
        checkpoints = max_num_seqs if num_speculative_tokens else 0
        self.num_state_slots = max_num_seqs + 1 + num_state_snapshots + checkpoints if self.linear else 0
        self.config = config
        self.abstract = abstract
        self.lora = lora
        self.mesh = mesh
        self.page_size = page_size
        self.max_blocks = -(-max_model_len // page_size)
        self.num_pages = num_pages  # per layer slab
        self.num_speculative_tokens = num_speculative_tokens
        platform = self._platform(params, mesh, abstract)
        grouped = kv_layout is not None and len(kv_layout.groups) > 1
        self.scan = use_scan(scan_layers, platform, grouped) and not self.linear  # the hybrid runs unrolled
        self._init_groups(kv_layout)
        self.stacked_order = stacked_order(platform) if self.scan else ()  # the stacked weights' axis order
        self.params = self._stack(params, mesh, abstract) if self.scan else params
        # CPU: the projections packed once for the CPU GEMM, in a record beside the params (`model.cpu_weights`).
        self.cpu_pack: cpu_weights.PackReport | None = None
        if cpu_weights.wanted(config.model_type, platform, self.scan, mesh, abstract):
            self.params, self.cpu_pack = cpu_weights.pack_params(self.params, config)
            log.info(
                "packed %d weights for the CPU GEMM (%s) in %.2f s",
                self.cpu_pack.weights,
                self.cpu_pack.isa,
                self.cpu_pack.seconds,
            )
        self._init_buckets(max_model_len, max_num_seqs, max_num_batched_tokens, max_logit_bias)
        # Where a one-device runner's operands live: the default device, or an abstract runner's target device.
        one = jax.tree.leaves(self.params)[0].sharding if abstract and mesh is None else None
        self._rep = one if mesh is None else sharding.replicated(mesh)
        self.kv_dtype = quant.kv_cache_dtype(kv_dtype, config.dtype)
        self._init_kv(platform, one)
        step_key = self._init_step_functions(attention_backend, platform)
        self._init_lora(one)
        self.jobs = self._init_jobs(step_key, platform)
        self._init_device_constants()
        self.store = None if abstract or not executable_store else open_store(executable_store)
        self.device_seconds = 0.0  # time blocked waiting for the device (host idle)
        self.compile_stats = CompileStats()
        self.warm = False  # warm-up is over: a compile now stalls a step and is logged (`Executables.get`)
        self.deferred = False  # the warm-up left shapes to their first use: such a compile is no warning
        self.show_compiles = False  # a step waiting for a compile shows a progress bar on stderr (Python API)
        # Run each step in compiled shapes that hold it where its own are not compiled (`ready_shapes`).
        self.resolve_shapes = False
        self.ready_shapes = ReadyShapes(self, EXECUTABLES)
        # Told the exact jobs of a step that ran in larger compiled shapes (the engine's compile thread).
        self.want_compiled: Callable[[list[Job]], None] | None = None
        self.real_tokens = 0  # tokens of scheduled work, summed over steps
        self.padded_tokens = 0  # padding tokens added to reach the token bucket, summed over steps
        self.kv_transfer: KVTransfer | None = None  # copies to and from the host tier (`attach_host_tier`)
        # Multi-host serving's process 0: called with each step's plan before its sampling is dispatched.
        self.mirror: Callable[[StepPlan], None] | None = None

    # -- construction, in order ---------------------------------------------------------------------
    @staticmethod
    def _platform(params, mesh: jax.sharding.Mesh | None, abstract: bool) -> str:
        """The platform the steps compile for: the mesh's, an abstract runner's target device's, else this
        process's."""
        if mesh is not None:
            return mesh.devices.flat[0].platform
        if abstract:
            return next(iter(jax.tree.leaves(params)[0].sharding.device_set)).platform
        return jax.devices()[0].platform

    def _init_groups(self, kv_layout: KVLayout | None) -> None:
        """The KV cache groups (`paged_jax.kv_cache.groups`): a page of `num_slabs` layer slabs and one block table
        per group; None or one group: every layer's own slab of each page, one table."""
        num_layers = self.config.num_layers
        self.kv_layout = kv_layout or KVLayout((KVGroup(None, tuple(range(num_layers))),), num_layers)
        self.grouped = GroupedPages.of(self.kv_layout, num_layers)
        if self.grouped is not None and not self.scan:
            raise ValueError("kv_layout: KV cache groups need the scanned decoder (scan_layers 'auto' or 'on')")
        self.num_kv_groups = len(self.kv_layout.groups)
        self.num_slabs = self.kv_layout.slots_per_page  # num_layers for one group

    def _init_buckets(
        self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int, max_logit_bias: int
    ) -> None:
        """The step buckets, and the one fixed width of each sampling array whose size a request chooses (compiled
        at warm-up): the ban list (EOS + stop ids under min_tokens), the penalties' token history (prompt +
        output) and the bias columns of a step with a biased row (`paged_jax.worker.logit_bias`)."""
        self.buckets = StepBuckets.make(max_num_seqs, max_num_batched_tokens, self.num_speculative_tokens)
        self.max_num_seqs = max_num_seqs
        self.suppress_width = pow2_buckets(8, MAX_STOP_TOKEN_IDS + len(self.config.eos_token_ids))[-1]
        self.history_len = pow2_buckets(64, max_model_len)[-1]
        self.logit_bias_width = max_logit_bias

    def _init_kv(self, platform: str, one) -> None:
        """The page arrays (one stacked cache when scanned), or their specs for an abstract runner; lowering sees
        only `_kv_specs` (a background compile never touches pages a running step donated)."""
        config, mesh = self.config, self.mesh
        pages = self.num_pages * self.num_slabs if self.scan else self.num_pages
        if self.linear:  # a full layer's entry is its pages, a linear layer's its state pool
            n = self.num_state_slots
            if self.abstract:
                layer = abstract_kv(config, pages, self.page_size, self.kv_dtype, mesh, one, platform)
                state = abstract_state(config, n, one)
                self.kv_caches = tuple(state if config.is_linear_layer(i) else layer for i in range(config.num_layers))
            else:
                self.kv_caches = tuple(
                    allocate_state(config, n)
                    if config.is_linear_layer(i)
                    else allocate_kv(config, self.num_pages, self.page_size, self.kv_dtype, mesh, platform)
                    for i in range(config.num_layers)
                )
        elif self.abstract:
            layer = abstract_kv(config, pages, self.page_size, self.kv_dtype, mesh, one, platform)
            self.kv_caches = layer if self.scan else (layer,) * config.num_layers
        elif self.scan:
            self.kv_caches = allocate_kv(config, pages, self.page_size, self.kv_dtype, mesh, platform)
        else:
            self.kv_caches = tuple(
                allocate_kv(config, self.num_pages, self.page_size, self.kv_dtype, mesh, platform)
                for _ in range(config.num_layers)
            )
        self._kv_specs = jax.tree.map(
            lambda kv: jax.ShapeDtypeStruct(kv.shape, kv.dtype, sharding=kv.sharding), self.kv_caches
        )

    def _init_step_functions(self, attention_backend: str, platform: str) -> StepKey:
        """The jitted forward steps (plain, and with oneDNN dots when they apply), the prompt-logprob step and
        the page copy; returns the plain forward step's key."""
        config, mesh = self.config, self.mesh
        weights = quant.weights_key(self.params)
        # Float weights only: an int8/fp8 weight's bf16 x bf16 -> f32 dot would be widened to f32 (3x slower).
        # Not with the CPU-weights record: the packed GEMM takes every weight dot, oneDNN would have none.
        onednn = xla_flags.use_onednn_dots(config.dtype, platform) and weights is None and self.cpu_pack is None
        # A scanned GPU step with float weights: cuBLAS dots, which read each layer's weight slice in place.
        self._scanned_gpu = self.scan and platform == "gpu" and weights is None
        quantized_kv = kv_quant.is_quantized_dtype(self.kv_dtype)
        key = StepKey(
            config=config,
            backend=attention_backend,
            mesh=mesh,
            quantized_kv=quantized_kv,
            weights=weights,
            lora=self.lora,
            scan=self.scan,
            stacked_order=self.stacked_order,
            grouped=self.grouped,
        )
        self.model, self._forward = step_functions(key)
        # The forward step of token buckets >= ONEDNN_MIN_TOKENS with oneDNN dots (its LM head rounded), or None.
        self._forward_onednn = None
        if onednn:
            _, self._forward_onednn = step_functions(dataclasses.replace(key, onednn=True))
            log.info(
                "%s forward steps of >= %d tokens compiled with oneDNN dots (%s=%s)",
                jnp.dtype(config.dtype).name,
                xla_flags.ONEDNN_MIN_TOKENS,
                xla_flags.ONEDNN_ENV,
                xla_flags.onednn_mode(),
            )
        self._prompt_logprobs = prompt_logprobs_function(key)
        self._copy = copy_pages_function(self.num_slabs, self.scan, mesh, quantized_kv)
        self._onednn = onednn
        return key

    def _init_lora(self, one) -> None:
        """The adapters' device slots (`paged_jax.lora.weights`) when LoRA is on: allocated, or specs when
        abstract."""
        self.lora_weights = None
        self._lora_write = None
        lora, config, mesh = self.lora, self.config, self.mesh
        if lora is None:
            return
        stacked = self.scan  # the scanned decoder indexes stacked arrays, the unrolled one reads each layer's own
        shardings = None if mesh is None else lora_shardings(config, mesh, lora, stacked)
        if self.abstract:
            shapes = lora_weights.abstract_weights(config, lora.max_loras, lora.max_rank, stacked)
            on = shardings or jax.tree.map(lambda _: one, shapes)
            self.lora_weights = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, on
            )
        else:
            self.lora_weights = lora_weights.allocate(config, lora.max_loras, lora.max_rank, stacked, shardings)
        self._lora_write = lora_writer(config, mesh, lora, stacked)

    def _init_jobs(self, step_key: StepKey, platform: str) -> CompileJobs:
        """The runner's compile jobs, keyed by what makes two runners' executables interchangeable."""
        key = RunnerKey(
            step=dataclasses.replace(step_key, onednn=self._onednn),
            resolved_backend=resolved_backend(step_key.backend, platform),
            max_blocks=self.max_blocks,
            max_seq_bucket=self.buckets.seqs[-1],
            params=fingerprint(self.params),
            kv_pages=fingerprint(self._kv_specs),
        )
        lora_specs = None
        if self.lora_weights is not None:
            lora_specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.lora_weights
            )
        return CompileJobs(
            key=key,
            config=self.config,
            params=self.params,
            kv_specs=self._kv_specs,
            lora_specs=lora_specs,
            rep=self._rep,
            forward_fn=self._forward,
            forward_onednn_fn=self._forward_onednn,
            prompt_logprobs_fn=self._prompt_logprobs,
            copy_fn=self._copy,
            lora_write_fn=self._lora_write,
            lora=self.lora,
            scanned_gpu=self._scanned_gpu,
            num_speculative_tokens=self.num_speculative_tokens,
            history_len=self.history_len,
        )

    def _init_device_constants(self) -> None:
        """The lookahead's merge input when there is no previous step, and the per-S all-ones bitmasks."""
        width = self.buckets.seqs[-1]
        self._no_prev_tokens = self.jobs.spec(width) if self.abstract else jnp.zeros(width, jnp.int32, device=self._rep)
        self._allow_all: dict[int, jax.Array] = {}  # the sampler's bitmask when no row is constrained, per S

    # -- buckets --------------------------------------------------------------------------------------
    @property
    def token_buckets(self) -> list[int]:
        return self.buckets.tokens

    @property
    def seq_buckets(self) -> list[int]:
        return self.buckets.seqs

    @property
    def copy_buckets(self) -> list[int]:
        return self.buckets.copies

    def seq_bucket(self, t: int, rows: int = 0) -> int:
        """`StepBuckets.seq_bucket`."""
        return self.buckets.seq_bucket(t, rows)

    def step_seq_buckets(self, t: int, forks: bool = False, fork_rows: int | None = None) -> list[int]:
        """`StepBuckets.step_seq_buckets`."""
        return self.buckets.step_seq_buckets(t, forks, fork_rows)

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
        tests and inspection; the step never slices). With KV cache groups: its slab of every page (a page holds
        this layer's KV only where its group's tables name it)."""
        if not self.scan:
            return self.kv_caches[layer]
        p = self.num_pages
        slab = self.kv_layout.slot_of_layer(self.config.num_layers)[layer]
        return jax.tree.map(lambda x: x[slab * p : (slab + 1) * p], self.kv_caches)

    # -- host side ----------------------------------------------------------------------------------
    def copy_pages(self, ops: list[PageCopy]) -> None:
        """Run the KV manager's copy-on-write instructions on every layer slab, in place."""
        self._run_copies(self._copy_chunks(ops))

    def _copy_chunks(self, pairs: Sequence[tuple[int, int]], resolve: bool = True) -> list[CopyChunk]:
        """`(src, dst)` row copies as dispatches of a copy executable (pages, or a hybrid's state rows): chunks of
        the largest copy bucket (copies are independent), each padded to its bucket with the null row copied onto
        itself; `resolve`: raised to a compiled page-copy bucket (`ready_shapes`) when shapes are resolved."""
        top = self.copy_buckets[-1]
        chunks = []
        for start in range(0, len(pairs), top):
            chunk = pairs[start : start + top]
            n = bucket_for(len(chunk), self.copy_buckets)
            n = self.ready_shapes.copy_bucket(n) if resolve and self.resolve_shapes else n
            src = np.zeros(n, np.int32)
            dst = np.zeros(n, np.int32)
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk, strict=True)
            chunks.append(CopyChunk(src, dst))
        return chunks

    def _run_copies(self, chunks: list[CopyChunk]) -> None:
        for chunk in chunks:
            self.kv_caches = self._executable(self.jobs.copy(len(chunk.src)))(self.kv_caches, chunk.src, chunk.dst)

    def attach_host_tier(self, tier: HostTier) -> KVTransfer:
        """Give the pages a host tier (`paged_jax.worker.kv_transfer`): its slots are allocated in the layout of
        this runner's cache, and each step's `kv_transfers` run before its forward pass."""
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner has no KV pages to copy")
        if self.linear:
            raise ConfigError(
                f"kv_host_cache_gib: the KV tiers (host memory, disk) are not supported for {self.config.model_type!r} "
                "(linear-attention layers keep per-sequence state, not only pages)"
            )
        self.kv_transfer = KVTransfer(self.kv_caches, self.num_pages, tier)
        return self.kv_transfer

    def load_lora(self, load: SlotLoad) -> None:
        """Write an adapter into its device slot, in place (the same executable for every slot and adapter)."""
        assert self.lora is not None, "adapter loads are scheduled only when LoRA is on"
        arrays, scaling = lora_weights.slot_arrays(load.adapter, self.config, self.lora.max_rank, self.scan)
        write = self._executable(self.jobs.lora_write())
        self.lora_weights = write(self.lora_weights, np.int32(load.slot), arrays, scaling)

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
        self._host_side_loads(sched)
        return self.run_plan(self.plan_forward(sched, prev_samples is not None), prev_samples)

    def plan_forward(self, sched: SchedulerOutput, has_prev: bool, sampling: bool = True) -> StepPlan:
        """The host half of a step (`paged_jax.worker.step_plan`): its page copies, buckets and every input array;
        `has_prev`: the previous step's samples are still on the device (the lookahead); `sampling`: False for
        a greedy draft step (no sampler inputs)."""
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner has no KV pages: it compiles steps, it cannot run one")
        copies = self._copy_chunks(sched.copy_ops) if sched.copy_ops else []
        t = bucket_for(sched.num_tokens, self.token_buckets)
        s = self.seq_bucket(t, max(len(sched.scheduled), len(sched.sample_rows)))
        flags = None
        if self.resolve_shapes:
            t, s, flags = self._compiled_shape(sched, t, s, has_prev, greedy=not sampling)
        step = build_step_inputs(sched, t, s, self.page_size, self.max_blocks, self.num_kv_groups)
        self.real_tokens += sched.num_tokens
        self.padded_tokens += t - sched.num_tokens
        state = build_state_meta(sched, t, s, linear_backend(self.jobs.key.resolved_backend)) if self.linear else None
        restores, after = list(sched.state_restores), list(sched.state_copies)
        if not sampling:
            return StepPlan(
                copies, t, s, flags, step, has_prev, None, state=state, state_restores=restores, state_copies=after
            )
        inputs = build_sampling_inputs(
            sched.sample_rows,
            s,
            self.suppress_width,
            self.history_len,
            self.config.eos_token_ids,
            self.logit_bias_width,
        )
        verify = verify_rows(sched, s) if self.num_speculative_tokens else None
        prompt, pool = build_prompt_rows(sched, t), build_pool_rows(sched, t, s)
        return StepPlan(
            copies,
            t,
            s,
            flags,
            step,
            has_prev,
            inputs,
            verify,
            prompt,
            pool,
            state=state,
            state_restores=restores,
            state_copies=after,
        )

    def run_plan(self, plan: StepPlan, prev_samples: SamplerOutput | None = None) -> ForwardLaunched:
        """The device half of `launch_forward`: dispatch `plan`'s copies, forward step, prompt logprobs and pooling
        (every process of a multi-host server runs the same plans, `paged_jax.engine.multihost`)."""
        assert plan.sampling is not None, "a greedy draft step runs through launch_greedy"
        fwd = self._run_forward(plan, prev_samples)
        prompt = None
        if plan.prompt is not None:
            rows = plan.prompt
            job = self.jobs.prompt_logprobs(fwd.t)
            prompt = self._executable(job)(self.params, fwd.hidden, rows.rows, rows.targets, rows.num_rows)
        pooled = None
        if plan.pool is not None:
            pool = plan.pool
            pooled = self._executable(self.jobs.pool(fwd.t, fwd.s))(fwd.hidden, pool.rows, pool.segments)
        m = self._with_history(plan.sampling, prev_samples)
        flags = fwd.flags or plan.sampling.flags
        return ForwardLaunched(fwd.logits, m, flags, fwd.s, plan.verify, prompt, pooled, plan)

    def replay(self, plan: StepPlan, prev_samples: SamplerOutput | None) -> SamplerOutput:
        """Run another runner's step from its plan (a multi-host follower, `serve.multihost`): the same executables
        on the same inputs; `prev_samples`: this runner's samples of the step before (used when the plan's were)."""
        fwd = self.run_plan(plan, prev_samples if plan.has_prev else None)
        return self.launch_sample(fwd, plan.bitmask)

    def launch_greedy(self, sched: SchedulerOutput) -> jax.Array:
        """One step of `sched` taking each sample row's argmax whatever its sequence's sampling parameters (a draft
        model's proposals, `paged_jax.spec_decode.draft_model`); returns the ids on device ([seq_buckets[-1]] i32)."""
        self._host_side_loads(sched)
        fwd = self._run_forward(self.plan_forward(sched, False, sampling=False), None)
        s = fwd.s
        meta = SamplingMeta(**empty_meta(s, self.suppress_width, 1, self.logit_bias_width))  # type: ignore[arg-type]  # host numpy arrays: the jitted step's inputs
        job = self.jobs.sample(s, self.suppress_width, 1, GREEDY, self.logit_bias_width)
        return self._executable(job)(fwd.logits, meta, self._bitmask(s, None), None).tokens

    def _host_side_loads(self, sched: SchedulerOutput) -> None:
        """The KV tiers' page copies and the adapter loads of `sched`, before its step (one host only: multi-host
        serving runs without a host tier and without LoRA)."""
        if self.abstract:
            raise RuntimeError("an abstract ModelRunner has no KV pages: it compiles steps, it cannot run one")
        if sched.kv_transfers is not None:
            assert self.kv_transfer is not None, "host-tier copies are scheduled only with a host tier"
            self.kv_caches = self.kv_transfer.apply(self.kv_caches, sched.kv_transfers)
        elif self.kv_transfer is not None:
            self.kv_transfer.land()  # the last step's copies to the host (they were gathered before it ran)
        for load in sched.lora_loads:
            self.load_lora(load)

    def _run_forward(self, plan: StepPlan, prev_samples: SamplerOutput | None) -> _Forward:
        """The copies and the forward step of `plan`, dispatched without waiting."""
        self._run_copies(plan.copies)
        if plan.state_restores:
            self.copy_states(plan.state_restores)
        step, t, s = plan.step, plan.t, plan.s
        token_ids = step.token_ids
        if step.has_pending:
            assert prev_samples is not None, "a pending token comes from the previous step's samples"
            token_ids = self._executable(self.jobs.merge(t))(token_ids, step.prev_rows, prev_samples.tokens)
        meta = PagedMeta(step.slot_mapping, step.kv_lens, step.block_tables, step.cu_q_lens, step.num_seqs, plan.state)  # type: ignore[arg-type]  # host numpy arrays: the jitted step's inputs
        forward = self._executable(self.jobs.forward(t, s))
        lora = None if self.lora_weights is None else LoraBatch(self.lora_weights, step.lora_slots)  # type: ignore[arg-type]  # host numpy arrays: the jitted step's inputs
        logits, self.kv_caches, hidden = forward(
            self.params, self.kv_caches, token_ids, step.positions, meta, step.logits_indices, lora
        )
        if plan.state_copies:
            self.copy_states(plan.state_copies)
        return _Forward(logits, hidden, s, t, plan.flags)

    def copy_states(self, ops: list[StateCopy]) -> None:
        """Copy state rows in place on every linear layer: prefix hits' snapshots into slots (before the step),
        forks (the leader's state after the step that completed its prompt) and snapshots (after the step)."""
        for chunk in self._copy_chunks([(c.src, c.dst) for c in ops], resolve=False):
            job = self.state_copy_job(len(chunk.src))
            self.kv_caches = self._executable(job)(self.kv_caches, chunk.src, chunk.dst)

    def state_copy_job(self, n: int) -> Job:
        """Copying `n` state rows on every linear layer (one executable per copy bucket)."""
        fn = copy_states_function(linear_backend(self.jobs.key.resolved_backend))
        specs, i32 = self._kv_specs, self.jobs.spec
        return Job(("state_copy", self.jobs.key, n), lambda: fn.lower(specs, i32(n), i32(n)), f"state copy slots={n}")

    def _compiled_shape(
        self, sched: SchedulerOutput, t: int, s: int, merge: bool, greedy: bool = False
    ) -> tuple[int, int, SamplerFlags | None]:
        """(t, s) raised to compiled buckets and the compiled sampler variant covering the rows (`ready_shapes`;
        `greedy`: GREEDY's); (t, s, None) when nothing compiled holds the step (it then compiles its own shapes)."""
        flags = GREEDY
        for row in () if greedy else sched.sample_rows:
            flags = union(flags, request_flags(row.seq.params))
        prompt = any(item.prompt_logprob_positions for item in sched.scheduled)
        shape = self.ready_shapes.step_shape(t, s, flags, merge, prompt)
        if shape is None:
            return t, s, None
        if shape != (t, s, flags) and self.want_compiled is not None:
            self.want_compiled(self.ready_shapes.step_jobs(t, s, (flags,), merge, prompt))
        return shape

    def launch_sample(self, fwd: ForwardLaunched, bitmask: np.ndarray | None = None) -> SamplerOutput:
        """Dispatch the sampling of a launched forward step. `bitmask`: int32 [R, ceil(V / 32)] for the step's
        first R sample rows (`paged_jax.structured.bitmask`), None when no row is constrained (a device-resident
        all-ones mask is used: nothing crosses to the device). With a `mirror` (multi-host serving), the step's
        plan and bitmask go to the other processes first."""
        if self.mirror is not None and fwd.plan is not None:
            fwd.plan.bitmask = bitmask
            self.mirror(fwd.plan)
        m = fwd.meta
        job = self.jobs.sample(fwd.s, m.suppress.shape[1], m.history.shape[1], fwd.flags, m.logit_bias.shape[1])
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
        history = self._executable(self.jobs.history(len(sampling.pending_rows)))(
            m.history, sampling.pending_rows, sampling.pending_cols, prev
        )
        return m._replace(history=history)

    def collect(
        self,
        out: SamplerOutput,
        num_rows: int,
        prompt_logprobs: PromptLogprobs | None = None,
        num_prompt_rows: int = 0,
        pooled: jax.Array | None = None,
    ) -> StepResult:
        """Wait for a launched step and copy its first `num_rows` samples (and `num_prompt_rows` prompt-logprob
        rows, and its pooled sums) to the host."""
        t0 = time.perf_counter()
        host, prompt, pooled_host = jax.device_get((out, prompt_logprobs, pooled))
        self.device_seconds += time.perf_counter() - t0
        r = num_rows
        if prompt is not None:
            prompt = PromptLogprobs(*(a[:num_prompt_rows] for a in prompt))
        return StepResult(
            host.tokens[:r], host.logprob[:r], host.top_ids[:r], host.top_logprobs[:r], prompt, pooled_host
        )

    # -- executables --------------------------------------------------------------------------------
    def _executable(self, job: Job, off_step: bool = False) -> jax.stages.Compiled:
        """`off_step`: compiled on a thread off any step (`compile_now`), so never shown as a step's compile."""
        return EXECUTABLES.get(
            job.key,
            job.lower,
            self.compile_stats,
            warm=self.warm,
            describe=job.describe,
            options=job.options,
            store=self.store,
            deferred=off_step or self.deferred,
            show=not off_step and self.show_compiles,
        )

    def compile_now(self, job: Job) -> jax.stages.Compiled:
        """Compile (or load) `job` now on this thread, off any step (`paged_jax.worker.compile_worker`): after
        warm-up it is counted in `after_warmup` and logged as info."""
        return self._executable(job, off_step=True)

    def compile(self, jobs: list[Job], workers: int, progress=None, cancel=None, assist=None) -> int:
        """Compile `jobs` on `workers` threads (skipping those already compiled); returns how many were new.
        `cancel` (a threading.Event): stop starting compiles once set; `assist`: `Executables.compile_all`'s."""
        return len(
            EXECUTABLES.compile_all(
                ((job.key, job.lower, job.options) for job in jobs),
                self.compile_stats,
                workers,
                progress,
                cancel,
                self.store,
                assist,
            )
        )

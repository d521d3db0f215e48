"""The synchronous engine core: `add_request`, `step`, `abort`, `has_unfinished` (the `Engine` protocol).

Serving and the batch script both drive this loop. Each `step` schedules one batch (`paged_jax.sched.scheduler`),
runs it on the device (`paged_jax.worker.runner`), appends the sampled tokens, hands each to the output processor
(`paged_jax.engine.output_processor`: stop checks, detokenization, outputs) and frees the pages of every sequence
that finished. Every page a request holds goes back when it finishes, is aborted, or fails. With
`async_scheduling` the step looks one step ahead (`paged_jax.engine.lookahead`). With a `speculative_config` a
step also verifies drafts (`paged_jax.spec_decode`). A request with structured outputs
gets one grammar matcher per sample when it is added (`paged_jax.structured`); each sampled token advances
it, and each step's constrained rows get their bitmask filled while the device runs the forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from paged_jax.config import LINEAR_ATTENTION_TYPES, ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.config.pooling import read_pooler
from paged_jax.engine.compile_gate import CompileGate
from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, InputProcessor, ProcessedRequest
from paged_jax.engine.lookahead import Launched, Lookahead
from paged_jax.engine.output_processor import OutputProcessor, RequestState
from paged_jax.engine.protocol import EngineStats, kv_fields
from paged_jax.errors import FieldError
from paged_jax.kv_cache import DiskTier, HostTier, KVCacheManager, KVLayout, KVTransfers, StateSlots, SwapSpace
from paged_jax.kv_cache.invariants import check_manager_invariants, check_state_slots
from paged_jax.kv_cache.state_snapshots import StateSnapshots
from paged_jax.lora.registry import AdapterCache, SlotTable
from paged_jax.lora.request import LoRARequest
from paged_jax.model import quant
from paged_jax.model.linear_state import LinearState
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.sched.output import SchedulerOutput
from paged_jax.sched.scheduler import Scheduler
from paged_jax.sched.sequence import FinishReason, TokenSequence
from paged_jax.spec_decode.decoder import SpecDecoder
from paged_jax.spec_decode.setup import make_spec_decoder
from paged_jax.structured import LLGuidanceBackend, Matcher, StructuredLimits, StructuredRows
from paged_jax.tokenization.tokenizer import Tokenizer
from paged_jax.worker import sharding
from paged_jax.worker.executables import PROCESS as COMPILES
from paged_jax.worker.kv_budget import engine_kv_layout, kv_capacity_pages
from paged_jax.worker.kv_transfer import DISK_ONLY_HOST_PAGES, block_fingerprint, host_tier_pages
from paged_jax.worker.prompt_logprobs import PromptLogprobs, num_prompt_rows
from paged_jax.worker.runner import ModelRunner, StepResult
from paged_jax.worker.spec_verify import REJECTED
from paged_jax.worker.step_functions import LoraShape
from paged_jax.worker.swap_rates import measure_copy_rate, measure_flops_rate, swap_costs
from paged_jax.worker.warmup import WarmupPlan, WarmupProgress, run_warmup

log = logging.getLogger(__name__)

__all__ = ["LLMEngine"]


def state_snapshots(ec: EngineConfig) -> StateSnapshots | None:
    """A linear-attention hybrid's state snapshots for the prefix cache (None: prefix caching off); their rows
    follow the `max_num_seqs` + 1 state slots."""
    if not ec.enable_prefix_caching:
        return None
    interval = max(ec.page_size, ec.state_snapshot_interval // ec.page_size * ec.page_size)
    return StateSnapshots(num_state_snapshots(ec), ec.max_num_seqs + 1, ec.page_size, interval)


def num_state_snapshots(ec: EngineConfig) -> int:
    """Snapshot rows of a hybrid's state pool (0 with prefix caching off)."""
    return (ec.state_snapshots or ec.max_num_seqs) if ec.enable_prefix_caching else 0


def state_checkpoint_row(ec: EngineConfig) -> int | None:
    """The first speculation checkpoint row of a hybrid's state pool, after the slots and the snapshot rows (None:
    speculation off; `paged_jax.kv_cache.state_pool`)."""
    return None if ec.speculative is None else ec.max_num_seqs + 1 + num_state_snapshots(ec)


def make_runner(
    run_config: ModelConfig,
    params,
    ec: EngineConfig,
    num_pages: int,
    max_model_len: int,
    mesh: jax.sharding.Mesh | None,
    kv_layout: KVLayout | None = None,
    abstract: bool = False,
) -> ModelRunner:
    """The engine's runner for `ec` (its buckets, KV pages, LoRA slots and verify rows); `abstract`: nothing
    allocated, for compiling the engine's steps for a target without its devices (`paged_jax.engine.aot`)."""
    spec_tokens = 0
    if ec.speculative is not None:
        spec_tokens = ec.speculative.num_speculative_tokens
    return ModelRunner(
        run_config,
        params,
        num_pages=num_pages,
        page_size=ec.page_size,
        max_model_len=max_model_len,
        max_num_seqs=ec.max_num_seqs,
        max_num_batched_tokens=ec.max_num_batched_tokens,
        attention_backend=ec.attention_backend,
        kv_dtype=ec.kv_dtype,
        mesh=mesh,
        max_logit_bias=ec.max_logit_bias,
        lora=LoraShape(ec.max_loras, ec.max_lora_rank) if ec.enable_lora else None,
        num_speculative_tokens=spec_tokens,
        abstract=abstract,
        scan_layers=ec.scan_layers,
        executable_store=ec.executable_store,
        kv_layout=kv_layout,
        num_state_snapshots=num_state_snapshots(ec) if run_config.model_type in LINEAR_ATTENTION_TYPES else 0,
    )


def _first_local(devices: Sequence[jax.Device]) -> jax.Device:
    """This process's first device of `devices` (a multi-host mesh also holds other processes' devices)."""
    return next((d for d in devices if d.process_index == jax.process_index()), devices[0])


class LLMEngine:
    """One engine: one scheduler and KV manager over one device, or over a tensor-parallel group.

    `devices`: the group this engine runs on (`tensor_parallel_size` of them); default: the default device
    when TP is 1 (the single-device path), else the first `tensor_parallel_size` local devices. For
    several replicas use `paged_jax.engine.data_parallel.make_engine`. `warmup_plan`: the shapes compiled at
    start-up when `warmup` is on (default: every shape; `paged_jax.worker.warmup`).
    """

    def __init__(
        self,
        config: ModelConfig,
        params,
        tokenizer: Tokenizer,
        engine_config: EngineConfig | None = None,
        devices: Sequence[jax.Device] | None = None,
        warmup_plan: WarmupPlan | None = None,
    ):
        ec = engine_config or EngineConfig()
        ec.validate()
        linear = config.model_type in LINEAR_ATTENTION_TYPES  # a recurrent-state pool beside the pages
        if ec.data_parallel_size != 1:
            raise ValueError(
                "data_parallel_size: one LLMEngine is one replica; use paged_jax.engine.data_parallel.make_engine"
            )
        # Every EOS the model's files name ends generation (e.g. Llama-3-Instruct's <|eot_id|> and <|end_of_text|>).
        eos = tuple(dict.fromkeys((*config.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
        config = config.replace(eos_token_ids=eos) if eos != tuple(config.eos_token_ids) else config
        self.config, self.tokenizer, self.engine_config = config, tokenizer, ec
        self.max_model_len = ec.model_len(config.max_position_embeddings)
        kv_dtype = quant.kv_cache_dtype(ec.kv_dtype, config.dtype)
        tp = ec.tensor_parallel_size
        mesh, run_config = None, config
        if devices is not None or tp > 1:
            devices = list(devices) if devices is not None else sharding.dp_device_groups(1, tp)[0]
            if len(devices) != tp:
                raise ValueError(f"devices: tensor_parallel_size is {tp} but {len(devices)} devices were given")
            mesh = sharding.make_mesh(devices)
            run_config, params = sharding.shard_params(config, params, mesh)
        self.mesh = mesh
        self.spec: SpecDecoder | None = None
        spec_config = ec.speculative
        self.kv_layout = engine_kv_layout(config, ec)
        self.num_pages = kv_capacity_pages(
            run_config,
            ec,
            kv_dtype,
            None if mesh is None or devices is None else _first_local(devices),
            tp,
            self.max_model_len,
            layout=self.kv_layout,
        )
        spec_tokens = 0 if spec_config is None else spec_config.num_speculative_tokens
        self.host_tier = self._host_tier(run_config, params, ec, kv_dtype, mesh)
        self.kv = KVCacheManager(
            self.num_pages,
            ec.page_size,
            ec.enable_prefix_caching,
            groups=self.kv_layout.groups,
            max_step_tokens=(ec.chunk_size or ec.max_num_batched_tokens) + spec_tokens,
            host_tier=self.host_tier,
            snapshots=state_snapshots(ec) if linear else None,
        )
        self.adapters, lora_slots = None, None
        if ec.enable_lora:  # adapters are checked against the model's own shapes, slots use the run config's
            self.adapters = AdapterCache(config, ec.max_lora_rank, ec.max_cpu_loras or ec.max_loras)
            lora_slots = SlotTable(ec.max_loras)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            chunk_size=ec.chunk_size,
            enable_prefix_caching=ec.enable_prefix_caching,
            reserve_tokens=self.max_model_len if ec.reserve_full_length else None,
            watermark=ec.watermark,
            lora_slots=lora_slots,
            max_restore_pages=ec.kv_restore_pages_per_step,
            state_slots=StateSlots(ec.max_num_seqs, state_checkpoint_row(ec)) if linear else None,
        )
        self.runner = make_runner(run_config, params, ec, self.num_pages, self.max_model_len, mesh, self.kv_layout)
        if self.host_tier is not None:
            transfer = self.runner.attach_host_tier(self.host_tier)
            if ec.warmup:
                transfer.compile_all(self.runner.kv_caches)
            if ec.kv_preemption_mode != "recompute":
                self.scheduler.swap = self._swap_space(transfer, run_config, params, mesh)
        self.compile_gate = None  # background_compiles: no step compiles (`paged_jax.engine.compile_gate`)
        self._failed: list[RequestOutput] = []  # requests the gate failed, returned by the next `step`
        if ec.background_compiles:
            self.compile_gate = CompileGate(self.runner, ec.async_scheduling)
            self.runner.resolve_shapes = True
            self.runner.want_compiled = self.compile_gate.worker.want
        if spec_config is not None:
            self.spec = make_spec_decoder(spec_config, config, ec, self.max_model_len, self.num_pages)
        self.inputs = InputProcessor(
            tokenizer,
            vocab_size=config.vocab_size,
            max_model_len=self.max_model_len,
            max_n=self.max_n,
            defaults=ec.sampling_defaults,
            max_logit_bias=ec.max_logit_bias,
            reasoning_parser=ec.reasoning_parser,
            hidden_size=config.hidden_size,
        )
        if ec.pooler is None and ec.pooling is not None:  # embeddings by `pooling` alone (no model files read)
            ec.pooler = read_pooler(None, ec.pooling)
        self.outputs = OutputProcessor(
            tokenizer, eos_token_ids=config.eos_token_ids, max_model_len=self.max_model_len, seed=ec.seed
        )
        self.lookahead = Lookahead()
        limits = StructuredLimits(
            max_grammar_bytes=ec.structured_max_grammar_bytes, compile_timeout_s=ec.structured_compile_timeout_s
        )
        backend = LLGuidanceBackend(tokenizer, config.vocab_size, config.eos_token_ids, limits)
        self.structured = StructuredRows(backend, ec.structured_fill_budget_s)
        # padding included; a hybrid's state pool is not KV (`state_pool_bytes`)
        caches: Any = self.runner.kv_caches
        caches = [c for c in caches if not isinstance(c, LinearState)] if linear else caches
        self.kv_cache_bytes = sum(x.nbytes for x in jax.tree.leaves(caches))
        # Tokens per byte vs bfloat16 pages of the same run config (padded scale rows included).
        slabs = config.num_kv_layers if linear else self.kv_layout.slots_per_page
        bf16_bytes = quant.kv_bytes_per_page(run_config, jnp.bfloat16, ec.page_size, num_slabs=slabs) * self.num_pages
        self.kv_token_gain = bf16_bytes / self.kv_cache_bytes
        log.info(
            "KV cache: %d pages x %d tokens = %d tokens, %.1f MiB (%d layers, %d KV heads, head_dim %d; "
            "%s pages: %.2fx the tokens of bfloat16 in the same bytes)",
            self.num_pages - 1,
            ec.page_size,
            (self.num_pages - 1) * ec.page_size,
            self.kv_cache_bytes / 2**20,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            kv_dtype.name,
            self.kv_token_gain,
        )
        self.num_steps = 0
        self.num_launched = 0  # steps dispatched to the device (the engine loop's progress signal)
        self.num_appended = 0  # tokens appended to sequences (the speculation cost gate's yield)
        self.host_seconds = 0.0  # scheduling + bookkeeping time on the host
        if ec.warmup:
            self.warmup(warmup_plan)

    def _host_tier(
        self, run_config: ModelConfig, params, ec: EngineConfig, kv_dtype, mesh: jax.sharding.Mesh | None
    ) -> HostTier | None:
        """The host tier `ec.kv_host_cache_gib` asks for (`paged_jax.kv_cache.host_tier`) and behind it the disk
        tier of `ec.kv_disk_cache_dir`; None: off (or prefix caching is off: nothing is keyed). A linear-attention
        hybrid has none by default (its states are not pages; asking for one is refused by the runner)."""
        if run_config.model_type in LINEAR_ATTENTION_TYPES and not ec.kv_host_cache_gib and not ec.kv_disk_cache_dir:
            return None
        platform = jax.devices()[0].platform if mesh is None else mesh.devices.flat[0].platform
        slabs = self.kv_layout.slots_per_page
        page_bytes = quant.kv_bytes_per_page(run_config, kv_dtype, ec.page_size, num_slabs=slabs)
        replicas = jax.local_device_count() // ec.tensor_parallel_size  # data-parallel engines of this process
        pages = host_tier_pages(ec.kv_host_cache_gib, page_bytes, platform, replicas)
        disk = None
        if ec.kv_disk_cache_dir is not None and ec.enable_prefix_caching:
            fp = block_fingerprint(run_config, params, kv_dtype, ec.page_size, self.kv_layout)
            disk = DiskTier(ec.kv_disk_cache_dir, fp, int(ec.kv_disk_cache_gib * 2**30))
            pages = max(pages, DISK_ONLY_HOST_PAGES)  # the disk tier's copies go through the host tier
            log.info("KV disk tier: %s (%d blocks found)", disk.dir, len(disk.files))
        if pages < 1 or not ec.enable_prefix_caching:
            return None
        log.info("KV host tier: %d pages, %.1f MiB of host memory", pages, pages * page_bytes / 2**20)
        return HostTier(pages, disk)

    def _swap_space(self, transfer, run_config: ModelConfig, params, mesh: jax.sharding.Mesh | None) -> SwapSpace:
        """Swap on preemption (`paged_jax.kv_cache.swap`) over the host tier, its cost model's rates measured now
        with a warm-up (`paged_jax.worker.swap_rates`), else the platform's defaults."""
        assert self.host_tier is not None
        ec = self.engine_config
        platform = jax.devices()[0].platform if mesh is None else mesh.devices.flat[0].platform
        measured = None
        if ec.warmup:
            copy_rate, self.runner.kv_caches = measure_copy_rate(transfer, self.runner.kv_caches)
            measured = (copy_rate, measure_flops_rate(run_config.dtype))
        costs = swap_costs(params, run_config, self.host_tier.page_bytes, platform, measured)
        log.info(
            "KV swap on preemption (%s): copies %.2f GB/s, prefill %.1f TFLOP/s (%s)",
            ec.kv_preemption_mode,
            costs.copy_bytes_per_s / 1e9,
            costs.flops_per_s / 1e12,
            "measured" if measured else "platform defaults",
        )
        return SwapSpace(self.kv, self.host_tier, costs, ec.kv_preemption_mode)  # type: ignore[arg-type]

    def warmup(
        self,
        plan: WarmupPlan | None = None,
        progress: bool = True,
        what: str = "warm-up",
        cancel=None,
        tracker: WarmupProgress | None = None,
    ) -> int:
        """Compile the step shapes of `plan` (default: every shape) in parallel; see `paged_jax.worker.warmup`. Safe
        to call from another thread while steps run (it only compiles); `cancel` (a threading.Event) stops it;
        `tracker` counts the shapes done (the server's /health and metrics). With `background_compiles` its
        threads compile what waiting requests need first."""
        lookahead = self.engine_config.async_scheduling
        plan = plan or WarmupPlan(lookahead=lookahead)
        if self.engine_config.pooler is not None:  # it serves embeddings: their pooling steps too
            plan = dataclasses.replace(plan, pooling=True)
        assist = None if self.compile_gate is None else self.compile_gate.worker.assist  # requests' compiles first
        return run_warmup(self.runner, plan, progress, what=what, cancel=cancel, tracker=tracker, assist=assist)

    @property
    def max_n(self) -> int:
        """The most samples one request may ask for: every sample of a request must run in the same batch
        once its prompt completes, so `n` above `max_num_seqs` could never be scheduled."""
        return min(self.engine_config.max_n, self.engine_config.max_num_seqs)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | ChatPrompt | ProcessedRequest,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        group: str | None = None,
    ) -> None:
        """Queue a request (`params` None: the model's generation defaults). Raises FieldError naming the field
        when the request is invalid (`paged_jax.engine.input_processor`) or can never fit the KV cache; a
        `ProcessedRequest` (the fronts process each request once, on their own thread) is queued as it is;
        `lora_request`: run it with that adapter (`paged_jax.lora`; a LoraError, field `lora_request`, when it
        cannot be served); `group`: the client request it belongs to (the prompts of one multi-prompt API request),
        which takes one turn of the scheduler's admission round-robin for all of them (None: its own)."""
        adapter = None
        if lora_request is not None:
            if self.adapters is None:
                raise FieldError("lora_request", "LoRA is not enabled on this engine (enable_lora)")
            adapter = self.adapters.get(lora_request)
        if isinstance(prompt, ProcessedRequest):  # a front checked it already (`InputProcessor.process`)
            if params is not None or cache_salt is not None:
                raise TypeError("add_request: a ProcessedRequest carries its own params and cache_salt")
            processed = prompt
        else:
            request = GenerationRequest(prompt, params if params is not None else {}, cache_salt=cache_salt)
            processed = self.inputs.process(request)
        self.outputs.check_request_id(request_id)
        self._check_fits(len(processed.prompt_token_ids) + processed.params.max_tokens)
        masked = processed.params.structured_outputs is not None or processed.params.max_reasoning_tokens is not None
        if masked and self.spec is not None and processed.params.speculate:
            # A mask follows the grammar one sampled token at a time, and drafts are not checked against it: a
            # constrained request decodes without drafts (the others speculate beside it).
            processed = dataclasses.replace(processed, params=dataclasses.replace(processed.params, speculate=False))
        req = self.outputs.add_request(request_id, processed, arrival_time)
        params = req.params
        if masked:
            try:
                inner = processed.matchers  # compiled by a front, on its thread
                if inner is None and params.structured_outputs is not None:
                    inner = self.compile_matchers(params.structured_outputs, params.n)
                req.matchers = self.structured.with_thought(
                    inner, params.n, processed.thought, params.max_reasoning_tokens
                )
            except ValueError:
                self.outputs.pop(request_id)
                raise
        for seq in req.seqs:
            seq.lora = adapter
        self.scheduler.add(req.seqs[0], req.seqs[1:], group)

    def compile_matchers(self, spec: StructuredOutputs, n: int) -> list[Matcher]:
        """The grammar matchers of a structured-output request with `n` samples, its first mask computed, within
        the compile deadline (`paged_jax.structured`); thread-safe: a server's fronts call it on their own threads
        (`InputProcessor.grammars`). Raises FieldError naming the field."""
        return self.structured.matchers(spec, n)

    def _check_fits(self, total_tokens: int) -> None:
        if not self.kv.can_ever_fit(total_tokens):
            raise FieldError(
                "prompt",
                f"{total_tokens} tokens need {self.kv.peak_pages(total_tokens)} KV pages but "
                f"the cache has {self.num_pages - 1}",
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and return every page it holds; None if it is unknown or already done."""
        return self._end(request_id, FinishReason.ABORT)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        out = self._end(request_id, FinishReason.ERROR)
        if out is not None:
            out.error = message
        return out

    def _end(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        req = self.outputs.pop(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self._remove(seq, reason)
                seq.finish_time = time.monotonic()
        return self.outputs.output(req, final=True)

    def check_invariants(self) -> None:
        """The KV manager's invariants, and a hybrid's state slots: one per sequence holding pages (raises
        RuntimeError naming the broken one)."""
        check_manager_invariants(self.kv)
        if self.scheduler.swap is not None:
            self.scheduler.swap.check()
        if self.scheduler.state_slots is not None:
            check_state_slots(self.scheduler.state_slots, self.kv.requests.keys())
        if self.kv.snapshots is not None:
            self.kv.snapshots.check()

    def has_unfinished(self) -> bool:
        return len(self.outputs) > 0

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache entry (vLLM's `reset_prefix_cache`, an `AllBlocksCleared` KV event): only while no
        request is open (a running request's blocks stay findable); returns whether it did."""
        if self.has_unfinished():
            return False
        return self.kv.reset_prefix_cache()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> EngineStats:
        spec: dict[str, Any] = {} if self.spec is None else self.spec.stats.as_dict()
        compiles: dict[str, Any] = self.runner.compile_stats.as_dict()
        gate = self.compile_gate
        return EngineStats(
            **spec,
            **kv_fields(self.kv.stats()),
            num_preemptions=self.scheduler.num_preemptions,
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            **compiles,
            step_tokens=self.runner.real_tokens,
            step_padding_tokens=self.runner.padded_tokens,
            kv_cache_tokens=(self.num_pages - 1) * self.engine_config.page_size,
            kv_cache_token_gain=round(self.kv_token_gain, 3),
            requests_waiting_for_compile=0 if gate is None else len(gate.deferred),
            compiles_queued=0 if gate is None else gate.worker.busy,
            **self._state_fields(),
        )

    def _state_fields(self) -> dict[str, Any]:
        """A hybrid's state slot and snapshot figures (`EngineStats.state_*`; none for other models)."""
        slots, snapshots = self.scheduler.state_slots, self.kv.snapshots
        out: dict[str, Any] = {} if slots is None else {"state_slots_in_use": slots.num_in_use}
        if snapshots is not None:
            out |= {"state_snapshots_cached": snapshots.num_cached, "state_snapshot_hits": snapshots.num_hits}
        return out

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced tokens or finished.

        With `async_scheduling` (the default) the engine dispatches step n+1 before it waits for step n's
        samples (`paged_jax.engine.lookahead`); the outputs returned are then step n's. A step after which the
        engine is idle also writes out the KV tiers' last copies (`flush_kv_tiers`).
        """
        outputs = self._step()
        if self.host_tier is not None and self.lookahead.inflight is None and not self.has_unfinished():
            self.flush_kv_tiers()
        return outputs

    def flush_kv_tiers(self) -> None:
        """With no step in flight: copy the blocks the last steps computed to the host tier's writer (the disk
        tier's; a running engine does it with the next step's copies) and land every copy still on its way."""
        transfer = self.runner.kv_transfer
        assert self.host_tier is not None and transfer is not None and self.lookahead.inflight is None
        persists = self.host_tier.drain_persists()
        if persists:
            self.runner.kv_caches = transfer.apply(self.runner.kv_caches, KVTransfers(persists=persists))
        transfer.land()

    def _step(self) -> list[RequestOutput]:
        t0, appended, compiles = time.perf_counter(), self.num_appended, COMPILES.backend_compiles
        if not self.engine_config.async_scheduling:
            launched = self.launch_step()
            if launched is None:
                self.wait_for_compiles()
                return self.take_failed()
            outputs = self.finish_step(launched)
            self._observe(launched.sched, False, appended, t0, compiles)
            return self.take_failed() + outputs
        prev = self.lookahead.take()
        outputs = []
        spec = self.spec
        collected = None if prev is None else prev.sched
        synced = prev is not None and spec is not None and spec.needs_sync(prev.sched, self.scheduler.running, self.kv)
        if synced and prev is not None:
            outputs, prev = self.finish_step(prev), None  # speculating: the next step's drafts need these tokens
        if prev is not None:
            self.lookahead.mark_pending(prev, self._is_live, self.outputs.is_last_token)
        launched = self.launch_step(prev, defer_masks=True)
        if prev is not None:
            outputs = self.finish_step(prev)
        if launched is not None and launched.samples is None:  # constrained rows: their masks need prev's tokens
            launched = self.launch_sampling(launched)
        self.lookahead.inflight = launched
        if collected is not None:  # the step this call collected, timed with the next one's launch
            self._observe(collected, synced, appended, t0, compiles)
        if launched is None and prev is None:
            self.wait_for_compiles()
        return self.take_failed() + outputs

    @property
    def waiting_for_compiles(self) -> bool:
        """A request waits for its step shapes to compile (`paged_jax.engine.compile_gate`): a step that ran
        nothing is not idle."""
        return self.compile_gate is not None and self.compile_gate.waiting

    def wait_for_compiles(self) -> None:
        if self.waiting_for_compiles:
            assert self.compile_gate is not None
            self.compile_gate.wait()

    def stop_compiles(self, timeout: float | None = None) -> None:
        """Start no more background compiles and wait up to `timeout` for the running one (shut-down)."""
        if self.compile_gate is not None:
            self.compile_gate.worker.close(timeout)
        stop_draft = getattr(self.spec.proposer, "stop_compiles", None) if self.spec is not None else None
        if stop_draft is not None:  # a draft model's compile thread (`paged_jax.spec_decode.draft_gate`)
            stop_draft(timeout)

    def take_failed(self) -> list[RequestOutput]:
        """The final outputs of requests failed outside a step's rows since the last call (a compile failed)."""
        failed, self._failed = self._failed, []
        return failed

    def _observe(self, sched: SchedulerOutput, synced: bool, appended: int, t0: float, compiles: int) -> None:
        """Tell the speculative decoder what the step `sched`, collected by this `step` call, cost and yielded;
        not when the call compiled anything (`compiles`: the process's XLA compile count at its start; a shape's
        first use without warm-up): its compile seconds would read as the cost of decoding, and the cost gate
        would pause speculation for hundreds of steps after one compiled verify step."""
        if self.spec is not None and COMPILES.backend_compiles == compiles:
            self.spec.observe(sched, synced, self.num_appended - appended, time.perf_counter() - t0)

    def _is_live(self, seq: TokenSequence) -> bool:
        return not seq.finished and seq.request_id in self.outputs

    def launch_step(self, prev: Launched | None = None, defer_masks: bool = False) -> Launched | None:
        """First half of `step`: schedule and dispatch to the device without waiting (None: nothing to run).

        Every launched step must be passed to `finish_step` before the next `launch_step`. Data parallelism
        launches every replica's step before finishing any, so the replicas' devices run together. A step
        with structured-output rows dispatches its forward pass, fills their masks meanwhile and then
        dispatches its sampling; with `defer_masks` (the lookahead: the masks need `prev`'s tokens) its
        sampling is left to `launch_sampling`, after `finish_step(prev)`.
        """
        t0 = time.perf_counter()
        if self.spec is not None and prev is None:  # every token is on the host: propose drafts
            self.spec.propose(self.scheduler.running, self.kv)
        sched = self._schedule()
        if sched.empty:
            return None
        forward = self.runner.launch_forward(sched, None if prev is None else prev.samples)
        self.num_launched += 1
        launched = Launched(sched, None, time.perf_counter() - t0, forward)
        if defer_masks and self._constrained_rows(sched):
            return launched
        return self.launch_sampling(launched)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step, inside compiled shapes with `background_compiles` (`paged_jax.engine.compile_gate`)."""
        gate = self.compile_gate
        if gate is None:
            return self.scheduler.schedule()
        step = gate.plan(self.scheduler.running)
        sched = self.scheduler.schedule(step.budget, step.admit)
        for seq, why in step.failed:
            if (out := self.fail(seq.request_id, why)) is not None:
                self._failed.append(out)
        gate.after(sched.num_tokens, self.scheduler.running)
        return sched

    def launch_sampling(self, launched: Launched) -> Launched:
        """Fill the bitmask of `launched`'s structured-output rows (from their matchers' current state) and
        dispatch its sampling."""
        t0 = time.perf_counter()
        masks = self.structured.bitmask(self._constrained_rows(launched.sched), len(launched.sched.sample_rows))
        assert launched.forward is not None, "sampling is launched once, after its forward step"
        samples = self.runner.launch_sample(launched.forward, masks.bitmask)
        fwd = launched.forward
        seconds = launched.host_seconds + time.perf_counter() - t0
        return Launched(launched.sched, samples, seconds, None, fwd.prompt_logprobs, fwd.pooled, masks.late)

    def _constrained_rows(self, sched: SchedulerOutput) -> list[tuple[Matcher, int]]:
        """(matcher, sample row) of each live structured-output sequence `sched` samples."""
        rows = []
        for r, row in enumerate(sched.sample_rows):
            seq = row.seq
            req = self.outputs.get(seq.request_id)
            m = None if req is None or seq.finished else req.matcher(seq)
            if m is not None and self.structured.needs_mask(m):
                rows.append((m, r))
        return rows

    def finish_step(self, launched: Launched) -> list[RequestOutput]:
        """Second half of `step`: wait for the samples, append tokens, apply stops, free finished requests."""
        t0 = time.perf_counter()
        sched = launched.sched
        device0 = self.runner.device_seconds
        assert launched.samples is not None, "a step is finished after its sampling was launched"
        result = self.runner.collect(
            launched.samples, len(sched.sample_rows), launched.prompt_logprobs, num_prompt_rows(sched), launched.pooled
        )
        touched: dict[str, RequestState] = {}  # requests with news this step
        outputs = []
        if result.prompt_logprobs is not None:
            self._record_prompt_logprobs(sched, result.prompt_logprobs)
        if result.pooled is not None:
            self._record_pooled(sched, result.pooled, touched)
        for r, row in enumerate(sched.sample_rows):
            seq = row.seq
            req = self.outputs.get(seq.request_id)
            if req is None or seq.finished or result.tokens[r] == REJECTED:
                continue  # finished, aborted or failed while this step was in flight (or earlier in this loop); or a
                # row after a rejected draft
            if r in launched.late:  # its mask was not filled within the budget: its sample is discarded
                self._end_late(seq)
                touched[req.request_id] = req
                continue
            try:
                self._append(req, seq, result, r)
            except Exception as e:  # one request's failure (e.g. its tokenizer) ends that request alone
                log.exception("request %s failed", req.request_id)
                touched.pop(req.request_id, None)
                if (failed := self.fail(req.request_id, f"{type(e).__name__}: {e}")) is not None:
                    outputs.append(failed)
                continue
            touched[req.request_id] = req
        if self.spec is not None:
            self.spec.settle(sched, result.tokens, self.kv, self.scheduler.state_slots)
        for req in touched.values():
            done = req.finished
            outputs.append(self.outputs.output(req, final=done))
            if done:
                self.outputs.pop(req.request_id)
        self.num_steps += 1
        self.host_seconds += launched.host_seconds + time.perf_counter() - t0 - (self.runner.device_seconds - device0)
        return outputs

    def _record_prompt_logprobs(self, sched: SchedulerOutput, values: PromptLogprobs) -> None:
        """Hand each request its rows of the step's prompt logprobs (in scheduling order)."""
        row = 0
        for item in sched.scheduled:
            positions = item.prompt_logprob_positions
            req = self.outputs.get(item.seq.request_id)
            if positions and req is not None:
                self.outputs.add_prompt_logprobs(req, positions, values, row)
            row += len(positions)

    def _record_pooled(self, sched: SchedulerOutput, pooled, touched: dict[str, RequestState]) -> None:
        """Add each pooled sequence's row of the step's sums ([S, H], in scheduling order) into its request; a
        sequence whose prompt this step completed ends (an embedding is never sampled), its pages freed."""
        row = 0
        for item in sched.scheduled:
            if not item.pool_positions:
                continue
            seq, req = item.seq, self.outputs.get(item.seq.request_id)
            row += 1
            if req is None or seq.finished:
                continue
            req.add_pooled(pooled[row - 1])
            if item.pool_positions.stop == len(seq.prompt_token_ids):
                self._remove(seq, self.outputs.finish_prompt_only(req, seq))
                touched[req.request_id] = req

    def _append(self, req: RequestState, seq: TokenSequence, result: StepResult, row: int) -> None:
        """Sample `row` of `result` is `seq`'s next token (or its pending one): append it, check it, and free
        the sequence's pages if it ended. A prompt-only request (`max_tokens=0`) drops it and ends."""
        token = int(result.tokens[row])
        self.num_appended += 1
        if not self.lookahead.resolve(seq, token, self.kv):
            seq.append_token(token)
        if seq.params.max_tokens == 0:
            seq.drop_last_token()
            self._remove(seq, self.outputs.finish_prompt_only(req, seq))
            return
        k = seq.params.logprobs
        reason = self.outputs.check_token(req, seq, token, None if k is None else result.logprobs_of(row, k))
        matcher = req.matcher(seq)
        if matcher is not None and reason is None:
            reason = self._advance(seq, matcher, token)
            if reason is not None:
                seq.finish_time = time.monotonic()
        if reason is not None:
            self._remove(seq, reason)

    def _remove(self, seq: TokenSequence, reason: FinishReason) -> None:
        """End `seq`: its pages back to the pool, its speculation record (and draft KV) dropped."""
        self.scheduler.remove(seq, reason)
        if self.spec is not None:
            self.spec.release(seq)

    def _advance(self, seq: TokenSequence, matcher: Matcher, token: int) -> FinishReason | None:
        """Advance `seq`'s grammar by `token`: EOS when the grammar is complete (nothing may follow), ERROR (the
        reason as the stop reason) when it refused the token, failed (a resource limit) or took longer than the
        per-step budget."""
        error = self.structured.advance(matcher, token)
        if error is not None:
            seq.stop_reason = error
            return FinishReason.ERROR
        return FinishReason.EOS if matcher.is_stopped else None

    def _end_late(self, seq: TokenSequence) -> None:
        """End `seq`, whose mask fill passed the per-step budget, with ERROR: the token sampled under its unfilled
        mask is dropped (the lookahead's placeholder for it too) and its grammar is not advanced (the late fill
        may still be running on it)."""
        if seq.pending is not None:
            seq.drop_last_token()
            seq.pending = None
        seq.stop_reason = self.structured.late_message()
        seq.finish_time = time.monotonic()
        self._remove(seq, FinishReason.ERROR)

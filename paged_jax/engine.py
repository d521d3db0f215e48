"""The synchronous engine core: `add_request`, `step`, `abort`, `has_unfinished`.

Serving and the batch script both drive this loop. Each `step` schedules one batch, runs it on the
device, appends the sampled tokens, applies stop conditions, detokenizes incrementally and frees the
pages of every sequence that finished. Every page a request holds goes back when it finishes, is
aborted, or fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import quant, sharding
from paged_jax.config import ModelConfig
from paged_jax.detokenizer import Detokenizer
from paged_jax.kv_budget import cpu_kv_budget
from paged_jax.kv_cache import KVCacheManager
from paged_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from paged_jax.runner import ModelRunner, StepResult
from paged_jax.sampler import SamplerOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.scheduler import Scheduler, SchedulerOutput
from paged_jax.sequence import FinishReason, Sequence, Status
from paged_jax.tokenizer import Tokenizer
from paged_jax.warmup import WarmupPlan, run_warmup

log = logging.getLogger(__name__)

BACKENDS = ("auto", "xla", "pallas", "pallas-interpret")


@dataclass(slots=True)
class EngineConfig:
    """Engine options; names and defaults follow vLLM where one exists."""

    page_size: int = 16  # token slots per KV page
    num_pages: int | None = None  # explicit KV pages (page 0 is the null page); overrides the budgets below
    kv_cache_memory_fraction: float = 0.9  # of free accelerator memory, for KV pages
    cpu_kv_cache_bytes: int | None = None  # KV budget on CPU; None: 4 GiB, capped (see paged_jax.kv_budget)
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # token budget per step
    max_model_len: int | None = None  # prompt + output tokens; default min(model max, 8192)
    chunk_size: int | None = None  # max prompt tokens of one sequence per step (None: the token budget)
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | xla | pallas | pallas-interpret
    kv_dtype: str | None = None  # default: the model dtype; int8 / fp8_e4m3: quantized pages (paged_jax.quant)
    seed: int = 0  # seeds requests that do not set their own
    max_n: int = 64  # samples per request (also capped by max_num_seqs: a request's samples run together)
    warmup: bool = True  # compile every step shape at start-up (or call `warmup(plan)` later with False)
    watermark: float = 0.01  # fraction of pages admission keeps free while requests run
    async_scheduling: bool = True  # schedule step n+1 while the device runs step n (see LLMEngine.step)
    # Benchmark baseline: reserve max_model_len slots per request (no sharing), like a contiguous KV cache.
    reserve_full_length: bool = False
    tensor_parallel_size: int = 1  # chips per engine (weights by heads/columns/vocab, KV pages by KV heads)
    data_parallel_size: int = 1  # engine replicas on disjoint device groups (`paged_jax.dp.make_engine`)
    # SamplingParams fields a request gets when it leaves them unset (the model's generation_config.json;
    # see paged_jax.generation_defaults). Applied by LLM, batch and gRPC where "unset" is known.
    sampling_defaults: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend: must be one of {BACKENDS}, got {self.attention_backend!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_n", "tensor_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction: must be in (0, 1]")
        if self.cpu_kv_cache_bytes is not None and self.cpu_kv_cache_bytes <= 0:
            raise ValueError("cpu_kv_cache_bytes: must be positive (or None for the default)")
        quant.kv_cache_dtype(self.kv_dtype, jnp.float32)  # raises on an unknown name


def kv_capacity_pages(config: ModelConfig, ec: EngineConfig, kv_dtype, device: jax.Device | None = None,
                      kv_shards: int = 1, max_model_len: int = 8192) -> int:
    """Pages that fit the KV budget: 2 x layers x tokens x kv_heads x head_dim x bytes per token (plus the
    scales of quantized pages).

    With tensor parallelism each of the `kv_shards` chips holds 1 / kv_shards of every page (of the config
    the runner uses, KV heads replicated), and the budget is that of one chip (`device`).
    """
    if ec.num_pages is not None:
        return ec.num_pages
    per_page = quant.kv_bytes_per_token(config, kv_dtype) * ec.page_size // kv_shards
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * ec.kv_cache_memory_fraction)
    else:
        cpu = cpu_kv_budget(ec.cpu_kv_cache_bytes, per_page // ec.page_size, ec.max_num_seqs, max_model_len,
                            ec.page_size)
        log.info("KV cache budget on CPU: %.2f GiB (%s; --cpu-kv-cache-gib to change)", cpu.bytes / 2**30,
                 cpu.reason)
        budget = cpu.bytes
    return max(2, budget // per_page)


class _Launched(NamedTuple):
    """A step dispatched to the device and not yet collected."""

    sched: SchedulerOutput
    samples: SamplerOutput  # on device
    host_seconds: float  # host time spent launching


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[Detokenizer]
    arrival_time: float


class LLMEngine:
    """One engine: one scheduler and KV manager over one device, or over a tensor-parallel group.

    `devices`: the group this engine runs on (`tensor_parallel_size` of them); default: the default device
    when TP is 1 (the single-device path), else the first `tensor_parallel_size` local devices. For
    several replicas use `paged_jax.dp.make_engine`.
    """

    def __init__(self, config: ModelConfig, params, tokenizer: Tokenizer, engine_config: EngineConfig | None = None,
                 devices: Seq[jax.Device] | None = None):
        ec = engine_config or EngineConfig()
        ec.validate()
        if ec.data_parallel_size != 1:
            raise ValueError("data_parallel_size: one LLMEngine is one replica; use paged_jax.dp.make_engine")
        # Every EOS the model's files name ends generation (e.g. Llama-3-Instruct's <|eot_id|> and <|end_of_text|>).
        eos = tuple(dict.fromkeys((*config.eos_token_ids, *getattr(tokenizer, "eos_token_ids", ()))))
        config = config.replace(eos_token_ids=eos) if eos != tuple(config.eos_token_ids) else config
        self.config, self.tokenizer, self.engine_config = config, tokenizer, ec
        self.max_model_len = ec.max_model_len or min(config.max_position_embeddings, 8192)
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
        self.num_pages = kv_capacity_pages(run_config, ec, kv_dtype, None if mesh is None else devices[0], tp,
                                           self.max_model_len)
        self.kv = KVCacheManager(self.num_pages, ec.page_size, ec.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=ec.max_num_seqs,
                                   max_num_batched_tokens=ec.max_num_batched_tokens, chunk_size=ec.chunk_size,
                                   enable_prefix_caching=ec.enable_prefix_caching,
                                   reserve_tokens=self.max_model_len if ec.reserve_full_length else None,
                                   watermark=ec.watermark)
        self.runner = ModelRunner(run_config, params, num_pages=self.num_pages, page_size=ec.page_size,
                                  max_model_len=self.max_model_len, max_num_seqs=ec.max_num_seqs,
                                  max_num_batched_tokens=ec.max_num_batched_tokens,
                                  attention_backend=ec.attention_backend, kv_dtype=ec.kv_dtype, mesh=mesh)
        tokens = (self.num_pages - 1) * ec.page_size
        self.kv_cache_bytes = quant.kv_bytes_per_token(config, kv_dtype) * self.num_pages * ec.page_size
        self.kv_token_gain = quant.kv_token_gain(config, kv_dtype)  # tokens per byte vs bfloat16 pages
        log.info("KV cache: %d pages x %d tokens = %d tokens, %.1f MiB (%d layers, %d KV heads, head_dim %d; "
                 "%s pages: %.2fx the tokens of bfloat16 in the same bytes)", self.num_pages - 1, ec.page_size,
                 tokens, self.kv_cache_bytes / 2**20, config.num_layers, config.num_kv_heads, config.head_dim,
                 kv_dtype.name, self.kv_token_gain)
        self._requests: dict[str, _Request] = {}
        self._inflight: _Launched | None = None  # the lookahead's dispatched, uncollected step
        self._rng = np.random.default_rng(ec.seed)
        self.num_steps = 0
        self.num_launched = 0  # steps dispatched to the device (the engine loop's progress signal)
        self.host_seconds = 0.0  # scheduling + bookkeeping time on the host
        if ec.warmup:
            self.warmup()

    def warmup(self, plan: WarmupPlan | None = None, progress: bool = True, what: str = "warm-up",
               cancel=None) -> int:
        """Compile the step shapes of `plan` (default: every shape) in parallel; see `paged_jax.warmup`. Safe
        to call from another thread while steps run (it only compiles); `cancel` (a threading.Event) stops it."""
        lookahead = self.engine_config.async_scheduling
        return run_warmup(self.runner, plan or WarmupPlan(lookahead=lookahead), progress, what=what, cancel=cancel)

    @property
    def max_n(self) -> int:
        """The most samples one request may ask for: every sample of a request must run in the same batch
        once its prompt completes, so `n` above `max_num_seqs` could never be scheduled."""
        return min(self.engine_config.max_n, self.engine_config.max_num_seqs)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError naming the field when the request is invalid or can never fit."""
        params = params if params is not None else SamplingParams(**self.engine_config.sampling_defaults)
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params.validate(self.config.vocab_size, self.max_n)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if not ids:
                raise ValueError("prompt_token_ids: must not be empty")
            bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
                        or not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids: {bad!r} is not a token id in [0, {self.config.vocab_size})")
            ids = [int(t) for t in ids]
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        if not self.kv.can_ever_fit(total):
            raise ValueError(f"prompt: {total} tokens need {self.kv.pages_needed(total)} KV pages but the cache "
                             f"has {self.num_pages - 1}")
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(f"{request_id}#{i}", request_id, i, list(ids), params, seed, cache_salt, arrival_time=now)
                for i in range(params.n)]
        detoks = [Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                              params.spaces_between_special_tokens) for _ in seqs]
        self._requests[request_id] = _Request(request_id, text, list(ids), params, seqs, detoks, now)
        self.scheduler.add(seqs[0], seqs[1:])

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and return every page it holds; None if it is unknown or already done."""
        return self._end(request_id, FinishReason.ABORT)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        out = self._end(request_id, FinishReason.ERROR)
        if out is not None:
            out.error = message
        return out

    def _end(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.remove(seq, reason)
                seq.finish_time = time.monotonic()
        return self._output(req, final=True)

    def check_invariants(self) -> None:
        """The KV manager's invariants (raises RuntimeError naming the broken one)."""
        self.kv.check_invariants()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> dict:
        out = asdict(self.kv.stats())
        out["num_preemptions"] = self.scheduler.num_preemptions
        out["num_waiting"] = self.num_waiting
        out["num_running"] = self.num_running
        out.update(self.runner.compile_stats.as_dict())
        out["step_tokens"] = self.runner.real_tokens
        out["step_padding_tokens"] = self.runner.padded_tokens  # padding waste = padding tokens / step tokens
        out["kv_cache_dtype"] = self.runner.kv_dtype.name
        out["kv_cache_tokens"] = (self.num_pages - 1) * self.engine_config.page_size
        out["kv_cache_token_gain"] = round(self.kv_token_gain, 3)  # tokens per byte vs bfloat16 pages
        return out

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that produced tokens or finished.

        With `async_scheduling` (the default) the engine looks one step ahead: it schedules and dispatches
        step n+1 before it waits for step n's samples, feeding each sequence's not-yet-known token to step
        n+1 on the device, so the host's scheduling and bookkeeping overlap the device's work. The outputs
        returned are then step n's; a sequence that step n finishes (EOS, a stop) costs one wasted token
        of step n+1, which is discarded. A sequence with penalties gets its still-on-device token into its
        token history on the device too, so penalties do not turn the lookahead off.
        """
        if not self.engine_config.async_scheduling:
            launched = self.launch_step()
            return [] if launched is None else self.finish_step(launched)
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._mark_pending(prev)
        self._inflight = self.launch_step(prev)
        return [] if prev is None else self.finish_step(prev)

    def _mark_pending(self, prev: _Launched) -> None:
        """Give every sequence sampled by the in-flight step a placeholder for the token still on device."""
        for row, (seq, _) in enumerate(prev.sched.sample_rows):
            if seq.finished or seq.request_id not in self._requests:
                continue
            seq.append_token(-1)
            seq.pending_row = row
            seq.ends_after_pending = (len(seq.output_token_ids) >= seq.params.max_tokens
                                      or seq.num_tokens >= self.max_model_len)

    def launch_step(self, prev: _Launched | None = None) -> _Launched | None:
        """First half of `step`: schedule and dispatch to the device without waiting (None: nothing to run).

        Every launched step must be passed to `finish_step` before the next `launch_step`. Data parallelism
        launches every replica's step before finishing any, so the replicas' devices run together.
        """
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            return None
        samples = self.runner.launch(sched, self.kv, None if prev is None else prev.samples)
        self.num_launched += 1
        return _Launched(sched, samples, time.perf_counter() - t0)

    def finish_step(self, launched: _Launched) -> list[RequestOutput]:
        """Second half of `step`: wait for the samples, append tokens, apply stops, free finished requests."""
        t0 = time.perf_counter()
        sched = launched.sched
        device0 = self.runner.device_seconds
        result = self.runner.collect(launched.samples, len(sched.sample_rows))
        touched: dict[str, _Request] = {}
        outputs = []
        for r, (seq, _) in enumerate(sched.sample_rows):
            req = self._requests.get(seq.request_id)
            if req is None or seq.finished:
                continue  # finished, aborted or failed while this step was in flight (or earlier in this loop)
            try:
                self._append(req, seq, result, r)
            except Exception as e:  # one request's failure (e.g. its tokenizer) ends that request alone
                log.exception("request %s failed", req.request_id)
                touched.pop(req.request_id, None)
                outputs.append(self.fail(req.request_id, f"{type(e).__name__}: {e}"))
                continue
            touched[req.request_id] = req
        for req in touched.values():
            done = all(s.finished for s in req.seqs)
            outputs.append(self._output(req, final=done))
            if done:
                del self._requests[req.request_id]
        self.num_steps += 1
        self.host_seconds += launched.host_seconds + time.perf_counter() - t0 - (self.runner.device_seconds - device0)
        return outputs

    def _append(self, req: _Request, seq: Sequence, result: StepResult, row: int) -> None:
        token = int(result.tokens[row])
        p = seq.params
        if seq.has_pending:  # the lookahead already scheduled this token as a placeholder
            seq.set_last_token(token)
            seq.pending_row, seq.ends_after_pending = -1, False
            if seq.status is Status.RUNNING:
                self.kv.cache_blocks(seq.seq_id, seq.all_token_ids)
        else:
            seq.append_token(token)
        if p.logprobs is not None:
            top = [(int(i), float(v)) for i, v in zip(result.top_ids[row, : p.logprobs],
                                                      result.top_logprobs[row, : p.logprobs], strict=True)]
            seq.output_logprobs.append((float(result.logprob[row]), top))
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        detok = req.detoks[seq.index]
        n_out = len(seq.output_token_ids)
        reason, stop_reason = None, None
        if not p.ignore_eos and token in self.config.eos_token_ids and n_out >= p.min_tokens:
            reason = FinishReason.EOS
        elif token in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = FinishReason.STOP, token
        else:
            detok.add([token], check_stop=n_out >= p.min_tokens)
            if detok.stopped_on is not None:
                reason, stop_reason = FinishReason.STOP_STRING, detok.stopped_on
            elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            seq.stop_reason = stop_reason
            seq.finish_time = now
            self.scheduler.remove(seq, reason)

    def _output(self, req: _Request, final: bool) -> RequestOutput:
        """This step's output of `req`: what each sample added since the last output (the cost of a step is
        that of its new tokens, not of the whole output), plus the whole output when `final`."""
        completions = []
        for seq, detok in zip(req.seqs, req.detoks, strict=True):
            sent, seq.num_sent_tokens = seq.num_sent_tokens, len(seq.output_token_ids)
            new_ids = seq.output_token_ids[sent:]
            new_logprobs = None
            if seq.params.logprobs is not None:
                new_logprobs = [TokenLogprob(t, lp, top)
                                for t, (lp, top) in zip(new_ids, seq.output_logprobs[sent:], strict=True)]
            new_text = detok.take_delta(final=seq.finished)  # first: a finished sample's pending text is flushed
            c = CompletionOutput(index=seq.index, token_ids=[], text="",
                                 finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                                 stop_reason=seq.stop_reason, new_token_ids=new_ids, new_text=new_text,
                                 new_logprobs=new_logprobs)
            if final:
                c.token_ids, c.text = list(seq.output_token_ids), detok.text
                if seq.params.logprobs is not None:
                    c.logprobs = [TokenLogprob(t, lp, top)
                                  for t, (lp, top) in zip(seq.output_token_ids, seq.output_logprobs, strict=True)]
            completions.append(c)
        lead = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finish_time=max((s.finish_time for s in req.seqs if s.finish_time), default=None) if final else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_cached_prompt_tokens=lead.num_cached_prompt,
            num_preemptions=sum(s.num_preemptions for s in req.seqs))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, final, metrics)

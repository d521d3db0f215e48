"""What an engine is to the code that drives it: the `Engine` protocol and its `EngineStats`.

`LLMEngine` (one replica) and `DataParallelEngine` (several behind a router) both implement `Engine`; the batch
script, the server's engine loop, its metrics and its servicer are written against it. What drives an engine
calls `add_request` and then `step` until `has_unfinished` is False; `abort`/`fail` end one request at once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.input_processor import ChatPrompt, ProcessedRequest
from paged_jax.kv_cache import GroupStats, KVCacheStats
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import Matcher
from paged_jax.tokenization.tokenizer import Tokenizer
from paged_jax.worker.warmup import WarmupPlan, WarmupProgress


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine. Pages: see `paged_jax.kv_cache.KVCacheStats` (page 0 not counted); counters
    are cumulative since start-up."""

    pages_total: int
    pages_free: int
    pages_cached_free: int
    pages_in_use: int
    slot_utilization: float  # live token slots / slots of the pages in use (1.0 when none are in use)
    prefix_queries: int  # prompt tokens looked up at admission
    prefix_hits: int  # of those, tokens served from the prefix cache
    prefix_hit_rate: float
    evictions: int
    num_preemptions: int
    num_waiting: int  # sequences in the scheduler's waiting queue
    num_running: int
    compile_count: int  # step executables lowered and compiled (persistent-cache loads included)
    compile_seconds: float
    compile_cache_hits: int
    compiles_after_warmup: int
    step_tokens: int  # tokens of scheduled work, summed over steps
    step_padding_tokens: int  # padding added to reach each step's token bucket (waste = this / step_tokens)
    compile_lower_seconds: float = 0.0  # of compile_seconds, tracing and lowering (a persistent-cache hit pays it)
    executables_loaded: int = 0  # step executables loaded from the executable store (not lowered, not compiled)
    executable_load_seconds: float = 0.0  # looking them up and loading them (summed over threads)
    kv_cache_tokens: int = 0  # token slots of the KV pages (page 0 not counted)
    kv_cache_token_gain: float = 1.0  # tokens per KV byte relative to bfloat16 pages (int8 pages: ~1.94)
    # layer-token slots some layer can still read / those of the pages in use (`KVCacheStats.kv_utilization`)
    kv_utilization: float = 1.0
    kv_groups: tuple[GroupStats, ...] = ()  # per KV cache group: its window, layers and pages in use
    # The host tier (paged_jax.kv_cache.host_tier; zeros without one): of prefix_hits, tokens restored from it; its
    # slots and those held; blocks restored (hits), evicted pages copied in (offloads), entries it dropped; bytes
    # copied each way and the host time the copies took.
    prefix_hits_host: int = 0
    kv_host_pages_capacity: int = 0
    kv_host_pages_held: int = 0
    kv_host_hits: int = 0
    kv_host_offloads: int = 0
    kv_host_evictions: int = 0
    kv_host_bytes_to_host: int = 0
    kv_host_bytes_to_device: int = 0
    kv_host_copy_seconds: float = 0.0
    # Swap on preemption (paged_jax.kv_cache.swap): preempted requests swapped out to the host tier (the rest of
    # num_preemptions recomputed), swapped back in, host slots their pages hold now, bytes copied each way.
    kv_host_swap_outs: int = 0
    kv_host_swap_ins: int = 0
    kv_host_swap_pages_held: int = 0
    kv_host_swap_bytes_to_host: int = 0
    kv_host_swap_bytes_to_device: int = 0
    # The disk tier (paged_jax.kv_cache.disk_tier; zeros without one): files and bytes held, blocks read back, files
    # written, files rejected (truncated, corrupt, foreign: deleted), write faults, files deleted for size.
    # Linear-attention hybrids (paged_jax.kv_cache.state_pool, state_snapshots; zeros otherwise): state slots held
    # by running sequences, state snapshots cached for the prefix cache, prefix hits restored from one.
    state_slots_in_use: int = 0
    state_snapshots_cached: int = 0
    state_snapshot_hits: int = 0
    kv_disk_files: int = 0
    kv_disk_bytes: int = 0
    kv_disk_hits: int = 0
    kv_disk_writes: int = 0
    kv_disk_rejected: int = 0
    kv_disk_write_errors: int = 0
    kv_disk_evictions: int = 0
    # Speculative decoding (paged_jax.spec_decode.SpecStats): runs verified, drafts scored, drafts kept, their ratio,
    # kept
    # per run, and per draft position the share kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_acceptance_per_position: tuple[float, ...] = ()
    # Background compiles (`paged_jax.engine.compile_gate`): requests held back until their step shapes compile,
    # and step executables queued or compiling on the compile thread.
    requests_waiting_for_compile: int = 0
    compiles_queued: int = 0
    replicas: tuple[EngineStats, ...] = ()  # each replica's own (data parallelism only)

    @property
    def pages_in_use_ratio(self) -> float:
        """Pages in use / usable pages."""
        return self.pages_in_use / max(1, self.pages_total)

    @classmethod
    def combine(cls, per: Sequence[EngineStats]) -> EngineStats:
        """Replicas' stats as one: counts summed, rates recomputed from the sums, `replicas` = `per`."""
        skip = ("replicas", "spec_acceptance_per_position", "kv_groups")
        sums = {f.name: sum(getattr(s, f.name) for s in per) for f in dataclasses.fields(cls) if f.name not in skip}
        queries, in_use = sums["prefix_queries"], sums["pages_in_use"]
        sums["prefix_hit_rate"] = sums["prefix_hits"] / queries if queries else 0.0
        sums["slot_utilization"] = sum(s.slot_utilization * s.pages_in_use for s in per) / in_use if in_use else 1.0
        sums["kv_utilization"] = sum(s.kv_utilization * s.pages_in_use for s in per) / in_use if in_use else 1.0
        sums["kv_groups"] = tuple(
            dataclasses.replace(g, pages_in_use=sum(s.kv_groups[i].pages_in_use for s in per))
            for i, g in enumerate(per[0].kv_groups if per else ())
        )
        sums["kv_cache_token_gain"] = per[0].kv_cache_token_gain if per else 1.0  # the same pages everywhere
        drafts, tokens = sums["spec_drafts"], sums["spec_draft_tokens"]
        sums["spec_acceptance_rate"] = sums["spec_accepted_tokens"] / tokens if tokens else 0.0
        sums["spec_mean_accepted_length"] = sums["spec_accepted_tokens"] / drafts if drafts else 0.0
        return cls(**sums, replicas=tuple(per))


def kv_fields(kv: KVCacheStats) -> dict:
    """The `EngineStats` fields of a KV manager's snapshot (its per-group records kept as records)."""
    fields = {f.name: getattr(kv, f.name) for f in dataclasses.fields(kv) if f.name not in ("groups", "host", "disk")}
    host = {} if kv.host is None else {"kv_host_" + k: v for k, v in dataclasses.asdict(kv.host).items()}
    disk = {} if kv.disk is None else {"kv_disk_" + k: v for k, v in dataclasses.asdict(kv.disk).items()}
    return {**fields, **host, **disk, "kv_groups": kv.groups}


class Engine(Protocol):
    """The surface the batch script and the server drive (see the module docstring)."""

    config: ModelConfig
    tokenizer: Tokenizer
    engine_config: EngineConfig
    max_model_len: int
    num_pages: int  # KV pages of one replica, the null page included (a request must fit one replica)
    num_steps: int
    num_launched: int  # steps dispatched to the device (the engine loop's progress signal)

    @property
    def max_n(self) -> int: ...  # the most samples one request may ask for

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def waiting_for_compiles(self) -> bool: ...  # a step that ran nothing is not idle (`engine.compile_gate`)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | ChatPrompt | ProcessedRequest,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        group: str | None = None,  # requests sharing it take one turn of admission together (one client request)
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def fail(self, request_id: str, message: str) -> RequestOutput | None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def check_invariants(self) -> None: ...

    def reset_prefix_cache(self) -> bool: ...  # vLLM's: only while idle; whether it did

    def compile_matchers(self, spec: StructuredOutputs, n: int) -> list[Matcher]: ...  # thread-safe

    def stop_compiles(self, timeout: float | None = None) -> None: ...  # the compile thread: no new compile

    def warmup(
        self,
        plan: WarmupPlan | None = None,
        progress: bool = True,
        what: str = "warm-up",
        cancel: threading.Event | None = None,
        tracker: WarmupProgress | None = None,
    ) -> int: ...

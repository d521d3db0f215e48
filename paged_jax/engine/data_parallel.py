"""Data parallelism: independent engine replicas on disjoint device groups behind one engine-shaped front.

Each replica is a whole `LLMEngine` (its own scheduler, KV manager and page arrays) on its own group of
`tensor_parallel_size` devices. `DataParallelEngine` implements the same `paged_jax.engine.protocol.Engine` protocol
as `LLMEngine`, so it drops in wherever the batch script or the server takes an engine.

Routing: a request goes to the replica with the fewest unfinished sequences (ties to the lowest index),
and stays there until it finishes (its KV lives there). One `step` launches every busy replica's step
before waiting for any, so the device groups compute at the same time while the host prepares the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import jax

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.input_processor import ChatPrompt, ProcessedRequest
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.protocol import EngineStats
from paged_jax.errors import FieldError
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import Matcher
from paged_jax.tokenization.tokenizer import Tokenizer
from paged_jax.worker import sharding


@dataclasses.dataclass(slots=True)
class LeastLoadedRouter:
    """Picks the replica with the fewest unfinished sequences; remembers where each request went."""

    num_replicas: int
    load: list[int] = dataclasses.field(default_factory=list)  # unfinished sequences per replica
    owner: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # request id -> (replica, seqs)

    def __post_init__(self) -> None:
        self.load = [0] * self.num_replicas

    def pick(self) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.load[i], i))

    def assign(self, request_id: str, replica: int, num_seqs: int) -> None:
        assert request_id not in self.owner, request_id
        self.owner[request_id] = (replica, num_seqs)
        self.load[replica] += num_seqs

    def release(self, request_id: str) -> int | None:
        """Forget a finished request; returns the replica it was on (None if unknown)."""
        entry = self.owner.pop(request_id, None)
        if entry is None:
            return None
        self.load[entry[0]] -= entry[1]
        return entry[0]


class DataParallelEngine:
    """`data_parallel_size` `LLMEngine` replicas behind one engine surface (see the module docstring).

    `device_groups`: one device list per replica (default `sharding.dp_device_groups` over local devices).
    """

    def __init__(
        self,
        config: ModelConfig,
        params,
        tokenizer: Tokenizer,
        engine_config: EngineConfig,
        device_groups: Seq[Seq[jax.Device]] | None = None,
    ) -> None:
        ec = engine_config
        ec.validate()
        groups = device_groups or sharding.dp_device_groups(ec.data_parallel_size, ec.tensor_parallel_size)
        if len(groups) != ec.data_parallel_size:
            raise ValueError(f"device_groups: data_parallel_size is {ec.data_parallel_size}, got {len(groups)} groups")
        replica_config = dataclasses.replace(ec, data_parallel_size=1)
        self.replicas = [LLMEngine(config, params, tokenizer, replica_config, devices=g) for g in groups]
        self.config, self.tokenizer, self.engine_config = config, tokenizer, ec
        self.max_model_len = self.replicas[0].max_model_len
        self.num_pages = self.replicas[0].num_pages  # per replica: a request must fit one replica
        self.router = LeastLoadedRouter(len(self.replicas))
        self.num_steps = 0

    def warmup(self, plan=None, progress: bool = True, what: str = "warm-up", cancel=None, tracker=None) -> int:
        """Every replica's `LLMEngine.warmup` (each replica has its own devices, so its own executables)."""
        return sum(r.warmup(plan, progress, what, cancel, tracker) for r in self.replicas)

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | ChatPrompt | ProcessedRequest,
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        group: str | None = None,
    ) -> None:
        """Queue a request on the least-loaded replica; FieldError as `LLMEngine.add_request`."""
        if request_id in self.router.owner:
            raise FieldError("request_id", f"{request_id!r} is already in use")
        i = self.router.pick()
        self.replicas[i].add_request(request_id, prompt, params, cache_salt, arrival_time, lora_request, group)
        self.router.assign(request_id, i, (params or SamplingParams()).n)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work: launch all, then collect all."""
        launched = [(r, r.launch_step()) for r in self.replicas if r.has_unfinished()]
        outputs: list[RequestOutput] = []
        for replica, step in launched:
            outputs += replica.take_failed()
            if step is not None:
                outputs += replica.finish_step(step)
        if all(step is None for _, step in launched):
            for replica, _ in launched:  # nothing ran: wait a little for a request's compile, if one waits for it
                replica.wait_for_compiles()
        for out in outputs:
            if out.finished:
                self.router.release(out.request_id)
        if launched:
            self.num_steps += 1
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        i = self.router.release(request_id)
        return None if i is None else self.replicas[i].abort(request_id)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        i = self.router.release(request_id)
        return None if i is None else self.replicas[i].fail(request_id, message)

    def has_unfinished(self) -> bool:
        return bool(self.router.owner)

    @property
    def max_n(self) -> int:
        return self.replicas[0].max_n

    @property
    def num_launched(self) -> int:
        return sum(r.num_launched for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    def compile_matchers(self, spec: StructuredOutputs, n: int) -> list[Matcher]:
        """`LLMEngine.compile_matchers` (every replica's grammar backend is the same; a matcher runs on any)."""
        return self.replicas[0].compile_matchers(spec, n)

    @property
    def waiting_for_compiles(self) -> bool:
        return any(r.waiting_for_compiles for r in self.replicas)

    def stop_compiles(self, timeout: float | None = None) -> None:
        for r in self.replicas:
            r.stop_compiles(timeout)

    def check_invariants(self) -> None:
        for r in self.replicas:
            r.check_invariants()

    def reset_prefix_cache(self) -> bool:
        """Every replica's prefix cache dropped, or none while any replica holds a request."""
        if self.has_unfinished():
            return False
        return all([r.reset_prefix_cache() for r in self.replicas])

    def stats(self) -> EngineStats:
        """Counters summed over replicas; rates recomputed from the sums; `replicas` holds each one's own."""
        return EngineStats.combine([r.stats() for r in self.replicas])


def make_engine(
    config: ModelConfig,
    params,
    tokenizer: Tokenizer,
    engine_config: EngineConfig,
    devices: Seq[jax.Device] | None = None,
) -> LLMEngine | DataParallelEngine:
    """An `LLMEngine` for one replica (TP over `devices`, default the first local devices), else a
    `DataParallelEngine`."""
    if engine_config.data_parallel_size == 1:
        return LLMEngine(config, params, tokenizer, engine_config, devices=devices)
    return DataParallelEngine(config, params, tokenizer, engine_config)


__all__ = ["DataParallelEngine", "LeastLoadedRouter", "make_engine"]

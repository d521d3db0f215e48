"""Prometheus metrics on their own port, in a registry of their own (several servers can share a process)."""

from __future__ import annotations

import hmac
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from paged_jax.engine.protocol import Engine, EngineStats
from paged_jax.outputs import RequestOutput
from paged_jax.worker.warmup import WarmupProgress

_PADDING_BUCKETS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "paged_jax_requests", "Finished RPCs by method and gRPC status", ["method", "status"], registry=r
        )
        self.prompt_tokens = Counter("paged_jax_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("paged_jax_generated_tokens", "Generated tokens (all samples)", registry=r)
        self.ttft = Histogram(
            "paged_jax_time_to_first_token_seconds",
            "Arrival at the engine to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "paged_jax_time_per_output_token_seconds",
            "Mean time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("paged_jax_queue_depth", "Requests accepted but not yet started", registry=r)
        self.waiting = Gauge("paged_jax_scheduler_waiting", "Sequences in the scheduler's waiting queue", registry=r)
        self.running = Gauge("paged_jax_running", "Sequences running in the engine", registry=r)
        self.pages_in_use_ratio = Gauge("paged_jax_kv_pages_in_use_ratio", "KV pages in use / usable pages", registry=r)
        self.kv_slot_utilization = Gauge(
            "paged_jax_kv_slot_utilization", "Live token slots / slots of pages in use", registry=r
        )
        self.kv_utilization = Gauge(
            "paged_jax_kv_utilization",
            "Layer-token KV slots some layer can still read / those of the pages in use (sliding windows count theirs)",
            registry=r,
        )
        self.kv_group_pages = Gauge(
            "paged_jax_kv_group_pages_in_use",
            "KV pages in use per KV cache group (window: its sliding window in tokens, 'full' for full attention)",
            ["group", "window"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "paged_jax_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r
        )
        self.preemptions = Counter("paged_jax_preemptions", "Sequences preempted for lack of KV pages", registry=r)
        self.kv_host_pages = Gauge(
            "paged_jax_kv_host_pages_held", "Evicted prefix blocks held in the host-memory KV tier", registry=r
        )
        self.kv_host_hits = Counter(
            "paged_jax_kv_host_hits", "Prefix blocks restored from the host-memory KV tier", registry=r
        )
        self.kv_host_offloads = Counter(
            "paged_jax_kv_host_offloads", "Evicted KV pages copied into the host-memory tier", registry=r
        )
        self.kv_host_bytes = Counter(
            "paged_jax_kv_host_bytes", "Bytes copied between KV pages and the host tier", ["direction"], registry=r
        )
        self.kv_host_copy_seconds = Counter(
            "paged_jax_kv_host_copy_seconds", "Host seconds spent issuing and landing host-tier copies", registry=r
        )
        self.kv_swaps = Counter(
            "paged_jax_kv_swaps",
            "Preempted requests swapped to the host tier (out) and back (in)",
            ["direction"],
            registry=r,
        )
        self.kv_swap_bytes = Counter(
            "paged_jax_kv_swap_bytes", "Bytes of swapped requests' KV pages copied", ["direction"], registry=r
        )
        self.kv_swap_pages = Gauge(
            "paged_jax_kv_swap_pages_held", "Host-tier slots held by swapped-out requests", registry=r
        )
        self.engine_alive = Gauge("paged_jax_engine_alive", "1 while the engine loop runs", registry=r)
        self.compiles = Counter(
            "paged_jax_compiles", "Step executables compiled (persistent cache loads included)", registry=r
        )
        self.compile_seconds = Counter(
            "paged_jax_compile_seconds",
            "Seconds spent compiling step executables (summed over compile threads)",
            registry=r,
        )
        self.compile_cache_hits = Counter(
            "paged_jax_compile_cache_hits", "Step executables loaded from the persistent compilation cache", registry=r
        )
        self.executables_loaded = Counter(
            "paged_jax_executables_loaded",
            "Step executables loaded from the executable store (neither lowered nor compiled)",
            registry=r,
        )
        self.compiles_after_warmup = Counter(
            "paged_jax_compiles_after_warmup",
            "Step shapes compiled after warm-up (on the compile thread while only the requests needing them wait)",
            registry=r,
        )
        self.requests_waiting_for_compile = Gauge(
            "paged_jax_requests_waiting_for_compile",
            "Requests held back until a step shape they need is compiled (the others keep running)",
            registry=r,
        )
        self.compiles_queued = Gauge(
            "paged_jax_compiles_queued", "Step executables queued or compiling on the compile thread", registry=r
        )
        self.step_tokens = Counter("paged_jax_step_tokens", "Tokens of scheduled work in steps", registry=r)
        self.step_padding_tokens = Counter(
            "paged_jax_step_padding_tokens", "Padding tokens added to reach each step's token bucket", registry=r
        )
        self.step_padding_ratio = Histogram(
            "paged_jax_step_padding_ratio",
            "Padding tokens / real tokens per step",
            buckets=_PADDING_BUCKETS,
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "paged_jax_spec_draft_tokens", "Speculative decoding: draft tokens scored by verify steps", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "paged_jax_spec_accepted_tokens", "Speculative decoding: draft tokens kept", registry=r
        )
        self.spec_drafts = Counter(
            "paged_jax_spec_drafts", "Speculative decoding: sequences verified with drafts", registry=r
        )
        self.spec_acceptance_rate = Gauge(
            "paged_jax_spec_acceptance_rate", "Speculative decoding: drafts kept / drafts scored", registry=r
        )
        self.spec_mean_accepted_length = Gauge(
            "paged_jax_spec_mean_accepted_length", "Speculative decoding: drafts kept per verified sequence", registry=r
        )
        self.spec_position_acceptance = Gauge(
            "paged_jax_spec_position_acceptance_rate",
            "Speculative decoding: per draft position, the share of runs reaching it that kept it",
            ["position"],
            registry=r,
        )
        self._preemptions_seen = 0
        self._seen: dict[str, float] = {}  # last value of each engine counter mirrored by a Counter
        self.queued_fn = lambda: 0
        self.queue_depth.set_function(lambda: self.queued_fn())
        self.warmup_fn: Callable[[], WarmupProgress | None] = lambda: None  # the server's warm-up, once started
        self.state_slots = Gauge(
            "paged_jax_state_slots_in_use", "Recurrent-state slots held by running sequences (hybrids)", registry=r
        )
        self.state_snapshots = Gauge(
            "paged_jax_state_snapshots_cached", "Recurrent-state snapshots kept for the prefix cache", registry=r
        )
        self.state_snapshot_hits = Counter(
            "paged_jax_state_snapshot_hits", "Prefix hits restored from a recurrent-state snapshot", registry=r
        )
        r.register(_WarmupCollector(self))

    def on_step(self, engine: Engine) -> None:
        """Engine gauges; runs on the engine loop thread after every step."""
        s = engine.stats()
        self.waiting.set(s.num_waiting)
        self.running.set(s.num_running)
        self.pages_in_use_ratio.set(s.pages_in_use_ratio)
        self.kv_slot_utilization.set(s.slot_utilization)
        self.kv_utilization.set(s.kv_utilization)
        for i, group in enumerate(s.kv_groups):
            window = "full" if group.window is None else str(group.window)
            self.kv_group_pages.labels(group=str(i), window=window).set(group.pages_in_use)
        self.prefix_hit_rate.set(s.prefix_hit_rate)
        self.kv_host_pages.set(s.kv_host_pages_held)
        self.kv_swap_pages.set(s.kv_host_swap_pages_held)
        for key, counter in (
            ("kv_host_hits", self.kv_host_hits),
            ("kv_host_offloads", self.kv_host_offloads),
            ("kv_host_bytes_to_host", self.kv_host_bytes.labels(direction="to_host")),
            ("kv_host_bytes_to_device", self.kv_host_bytes.labels(direction="to_device")),
            ("kv_host_copy_seconds", self.kv_host_copy_seconds),
            ("kv_host_swap_outs", self.kv_swaps.labels(direction="out")),
            ("kv_host_swap_ins", self.kv_swaps.labels(direction="in")),
            ("kv_host_swap_bytes_to_host", self.kv_swap_bytes.labels(direction="to_host")),
            ("kv_host_swap_bytes_to_device", self.kv_swap_bytes.labels(direction="to_device")),
            ("state_snapshot_hits", self.state_snapshot_hits),
        ):
            counter.inc(self._advance(key, s, commit=True))
        self.state_slots.set(s.state_slots_in_use)
        self.state_snapshots.set(s.state_snapshots_cached)
        self.requests_waiting_for_compile.set(s.requests_waiting_for_compile)
        self.compiles_queued.set(s.compiles_queued)
        new = s.num_preemptions - self._preemptions_seen
        if new > 0:
            self.preemptions.inc(new)
            self._preemptions_seen = s.num_preemptions
        real, padding = self._advance("step_tokens", s), self._advance("step_padding_tokens", s)
        if real > 0:
            self.step_padding_ratio.observe(padding / real)
        for key, counter in (
            ("compile_count", self.compiles),
            ("compile_seconds", self.compile_seconds),
            ("compile_cache_hits", self.compile_cache_hits),
            ("executables_loaded", self.executables_loaded),
            ("compiles_after_warmup", self.compiles_after_warmup),
            ("step_tokens", self.step_tokens),
            ("step_padding_tokens", self.step_padding_tokens),
            ("spec_drafts", self.spec_drafts),
            ("spec_draft_tokens", self.spec_draft_tokens),
            ("spec_accepted_tokens", self.spec_accepted_tokens),
        ):
            counter.inc(self._advance(key, s, commit=True))
        if s.spec_drafts:
            self.spec_acceptance_rate.set(s.spec_acceptance_rate)
            self.spec_mean_accepted_length.set(s.spec_mean_accepted_length)
            for j, rate in enumerate(s.spec_acceptance_per_position):
                self.spec_position_acceptance.labels(position=str(j)).set(rate)

    def _advance(self, key: str, stats: EngineStats, commit: bool = False) -> float:
        """How much engine counter `key` grew since it was last committed."""
        value = getattr(stats, key)
        delta = max(0.0, value - self._seen.get(key, 0))
        if commit:
            self._seen[key] = value
        return delta

    def on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generated_tokens.inc(m.num_generated_tokens)
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)

    def serve(self, host: str, port: int, token: str | None = None, tls: tuple[str, str] | None = None) -> int:
        """Start the HTTP endpoint; returns the bound port.

        `token`: every scrape must send `Authorization: Bearer <token>` (401 otherwise); `tls`: (certificate
        chain, key) PEM files, so that the token does not travel in clear text.
        """
        if token is None:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        else:
            server = make_server(host, port, _bearer(make_wsgi_app(self.registry), token), ThreadingWSGIServer, _Quiet)
            if tls is not None:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                context.load_cert_chain(*tls)
                server.socket = context.wrap_socket(server.socket, server_side=True)
            threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()


class _WarmupCollector:
    """`paged_jax_warmup_shapes_planned{phase}` and `..._done{phase}`: the step shapes of each warm-up phase
    ("warm-up", which health waits for, then "background warm-up"), read from the server's `WarmupProgress`
    at each scrape (no step runs while the first phase compiles, so `on_step` could not update them)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        planned = GaugeMetricFamily(
            "paged_jax_warmup_shapes_planned", "Step shapes a warm-up phase compiles or loads", labels=["phase"]
        )
        done = GaugeMetricFamily(
            "paged_jax_warmup_shapes_done", "Step shapes of a warm-up phase compiled or loaded so far", labels=["phase"]
        )
        progress = self.metrics.warmup_fn()
        for what, phase in list(progress.phases.items()) if progress is not None else ():
            planned.add_metric([what], phase.planned)
            done.add_metric([what], phase.done)
        yield planned
        yield done


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # scrapes are not worth a log line each
        pass


def _bearer(app: Callable, token: str) -> Callable:
    """A WSGI app that answers 401 unless the request carries `Authorization: Bearer <token>`."""
    expected = token.encode()

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        scheme, _, got = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        if hmac.compare_digest(got.strip().encode(), expected) and scheme.lower() == "bearer":
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"authorization: a valid 'Bearer <token>' is required\n"]

    return guarded

"""Serving options: where to listen, who may call, and the per-request limits enforced at the door."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from paged_jax.config.kv_events import KVEventsConfig
from paged_jax.engine.input_processor import InputLimits


@dataclass(frozen=True, slots=True)
class Backpressure:
    """How far a client may fall behind reading its request's events before the request is aborted (its pages
    freed, generation stopped): more than `max_backlog` events unread, or nothing read for `stall_timeout_s`
    while an event waits. None: no bound. Each event is one step's new tokens of one prompt, so the unread
    buffer of a stream is bounded by `max_backlog` steps' output however long its client stops reading."""

    max_backlog: int | None = None
    stall_timeout_s: float | None = None


PROMPT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) max_tokens of a completions request that sets none
MAX_MESSAGE_BYTES = 2**30  # one request's bytes (gRPC takes an int32; a body is held in memory whole)


@dataclass(slots=True)
class ServingLimits:
    """Per-request limits; a request beyond any of them gets INVALID_ARGUMENT naming the field.

    `max_prompt_tokens` 0 means "the model's length"; the engine also refuses prompt + max_tokens
    beyond `max_model_len` and requests that could never fit the KV cache.
    """

    max_prompt_tokens: int = 0
    max_tokens: int = 4096  # upper bound for SamplingParams.max_tokens
    # When the request and the model leave max_tokens unset. None: vLLM's defaults, the rest of the context for a
    # conversation (OpenAI chat) and 16 for a plain prompt (OpenAI completions); both capped by `max_tokens`.
    default_max_tokens: int | None = None
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 256
    max_cache_salt_chars: int = 256
    max_message_bytes: int = 4 * 2**20  # gRPC receive limit; larger messages get RESOURCE_EXHAUSTED
    # An HTTP body, checked before it is parsed (Content-Length first): larger ones get 413. 1 MiB holds a prompt
    # of about 250k tokens of English; a body is parsed whole while the GIL is held, ~0.1 s per MiB.
    max_body_bytes: int = 2**20
    max_chat_messages: int = 4096  # messages in one conversation, refused before the template renders them
    # One request's whole response: prompts x n x max_tokens generated tokens, and logprob entries (each token
    # with its alternatives): one max-n, max-tokens prompt fits; 64 of them, or 20 logprobs on each, do not.
    max_request_tokens: int = 65536
    max_logprob_entries: int = 131072

    def validate(self) -> None:
        for name in (
            "max_tokens",
            "max_n",
            "max_message_bytes",
            "max_body_bytes",
            "max_chat_messages",
            "max_request_tokens",
            "max_logprob_entries",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_message_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes: must be at most {MAX_MESSAGE_BYTES} (1 GiB), got {self.max_message_bytes}"
            )
        if self.max_body_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(f"max_body_bytes: must be at most {MAX_MESSAGE_BYTES} (1 GiB), got {self.max_body_bytes}")
        if self.default_max_tokens is not None and not 1 <= self.default_max_tokens <= self.max_tokens:
            raise ValueError(f"default_max_tokens: must be in [1, max_tokens ({self.max_tokens})]")

    def input_limits(self) -> InputLimits:
        """The bounds the engine's input processor applies to each request (all but the message size)."""
        return InputLimits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens=self.max_tokens,
            default_max_tokens=PROMPT_MAX_TOKENS if self.default_max_tokens is None else self.default_max_tokens,
            default_chat_max_tokens=self.max_tokens if self.default_max_tokens is None else self.default_max_tokens,
            max_n=self.max_n,
            max_stop_strings=self.max_stop_strings,
            max_stop_string_chars=self.max_stop_string_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_request_id_chars=self.max_request_id_chars,
            max_cache_salt_chars=self.max_cache_salt_chars,
            max_chat_messages=self.max_chat_messages,
            max_request_tokens=self.max_request_tokens,
            max_logprob_entries=self.max_logprob_entries,
        )


@dataclass(slots=True)
class ServingConfig:
    """The gRPC and HTTP fronts. Bind to loopback unless told otherwise; TLS and auth are off unless configured."""

    host: str = "127.0.0.1"
    port: int | None = 50051  # gRPC (None: not listening, 0: a free port)
    http_port: int | None = None  # the OpenAI-compatible HTTP front on `host` (None: off, 0: a free port)
    metrics_port: int | None = None  # Prometheus endpoint on its own port (None: off, 0: a free port)
    metrics_host: str = "127.0.0.1"
    tls_cert_file: str | None = None  # PEM certificate chain; with tls_key_file turns TLS on
    tls_key_file: str | None = None
    auth_token: str | None = None  # required as "authorization: Bearer <token>" metadata when set
    auth_exempt_health: bool = True  # health checks need no token (load balancers)
    # Metrics (HTTP /metrics and the metrics port) are unauthenticated unless this is set: then they need the
    # bearer token too (and the metrics port serves TLS when TLS is configured).
    metrics_auth: bool = False
    max_queued_requests: int = 256  # accepted but not yet started; beyond it RESOURCE_EXHAUSTED
    # Requests of several prompts (an OpenAI completions `prompt` list; each prompt holds a queue slot) are taken
    # only while the queue, with them, holds at most this share of `max_queued_requests`: the rest stays open to
    # one-prompt requests, so a client sending many-prompt requests cannot take the whole queue.
    multi_prompt_queue_share: float = 0.5
    # Backpressure for streams (SSE and gRPC): a request whose client has more than `max_stream_backlog` events
    # (one step's new tokens each) unread, or has read nothing for `stream_stall_timeout_s` while one waits, is
    # aborted (generation stops, its pages are freed). An HTTP connection whose sent data stays unread for
    # `http_send_timeout_s` is closed by the kernel (TCP_USER_TIMEOUT), so the connection and its buffers go too.
    max_stream_backlog: int = 256
    stream_stall_timeout_s: float = 30.0
    http_send_timeout_s: float = 60.0
    # GetStats(check_invariants=true) walks every KV page on the engine thread (149 ms at 230k pages), stalling
    # every stream: an operator's debugging tool, refused (PERMISSION_DENIED) unless turned on.
    allow_invariant_checks: bool = False
    # Niceness added to the fronts' threads (`serve.front_priority`): the engine's steps get the cores first when
    # both want them, so a flood of cheap (or bad) requests slows the fronts more than every request's steps. The
    # background warm-up, started on the same thread, runs at that priority too. 0: off (the default).
    front_nice: int = 0
    grace_period_s: float = 30.0  # on SIGTERM, in-flight requests get this long before they are aborted
    limits: ServingLimits = field(default_factory=ServingLimits)
    # LoRA adapters served as their own model names (`--lora-modules name=path`, paged_jax.lora.named), and
    # whether POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (off unless asked, as in vLLM).
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_runtime_updates: bool = False
    # The names the model is served under (`--served-model-name`); the first is the one replies carry. Empty:
    # the model's own name.
    served_model_names: tuple[str, ...] = ()
    kv_events: KVEventsConfig | None = None  # `--kv-events-config`: publish the prefix cache's changes (kv_events)

    def validate(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file: TLS needs both a certificate and a key file")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token: must not be empty")
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests: must be >= 1 (0 would refuse every request)")
        if not 0 < self.multi_prompt_queue_share <= 1:
            raise ValueError("multi_prompt_queue_share: must be in (0, 1]")
        if self.max_stream_backlog < 1:
            raise ValueError("max_stream_backlog: must be >= 1")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError("stream_stall_timeout_s: must be > 0")
        if not self.http_send_timeout_s > 0:
            raise ValueError("http_send_timeout_s: must be > 0")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError("http_port: must be in [0, 65536)")
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError("port: must be in [0, 65536)")
        if self.metrics_auth and self.auth_token is None:
            raise ValueError("metrics_auth: needs a bearer token (--auth-token-file or PAGED_JAX_AUTH_TOKEN)")
        if not 0 <= self.front_nice <= 19:
            raise ValueError("front_nice: must be in [0, 19] (a niceness added to the fronts' threads)")
        if self.grace_period_s < 0:
            raise ValueError("grace_period_s: must be >= 0")
        self.limits.validate()

    @property
    def backpressure(self) -> Backpressure:
        return Backpressure(self.max_stream_backlog, self.stream_stall_timeout_s)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def tls_files(self) -> tuple[str, str] | None:
        """(certificate, key) when TLS is on (`validate` refuses one without the other)."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return self.tls_cert_file, self.tls_key_file

    def warnings(self) -> list[str]:
        """Risky but valid settings, for the log at start-up."""
        out = []
        if self.auth_token is not None and not self.tls and not is_loopback(self.host):
            out.append(
                f"auth: the bearer token travels in clear text: {self.host} is not a loopback address and TLS "
                "is off (--tls-cert/--tls-key)"
            )
        if self.metrics_port is not None and not self.metrics_auth and not is_loopback(self.metrics_host):
            out.append(
                f"metrics: the metrics port on {self.metrics_host} is unauthenticated and not on loopback "
                "(--metrics-auth requires the bearer token there)"
            )
        return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, or "" / "0.0.0.0"-style wildcards handled above
        return False

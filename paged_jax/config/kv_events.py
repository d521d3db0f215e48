"""`KVEventsConfig`: whether and where a server publishes its KV cache events, in vLLM's `--kv-events-config` JSON
(the same field names, defaults and meaning as `vllm.config.kv_events.KVEventsConfig`), validated with errors
that name the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_BUFFER = 10_000_000  # buffer_steps, hwm, max_queue_size: batches or messages held in memory


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """`enable_kv_cache_events`: publish at all. `publisher`: "zmq" (a PUB socket) or "null" (none; the default
    when events are off, "zmq" when on). `endpoint`: the PUB socket, bound when it holds a wildcard (`tcp://*:5557`)
    or is ipc/inproc, else connected. `replay_endpoint`: a ROUTER socket (bound) answering a missed-range request
    with the last `buffer_steps` batches. `hwm`: the PUB socket's high-water mark (messages per subscriber before
    ZMQ drops). `max_queue_size`: batches waiting for the publisher thread (beyond it a batch is dropped and
    counted, never waited for). `topic`: the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publisher_kind(self) -> str:
        """The publisher in effect ("zmq" or "null"), vLLM's default resolved."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher_kind == "zmq"

    def validate(self) -> None:
        """ValueError naming the field."""
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events: must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher: must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"{name}: must be a ZMQ endpoint ({', '.join(ENDPOINT_SCHEMES)}...), got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BUFFER:
                raise ValueError(f"{name}: must be an integer in [1, {MAX_BUFFER}], got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic: must be a string, got {self.topic!r}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KVEventsConfig:
        """From vLLM's JSON object; an unknown field is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        config = cls(**raw)
        config.validate()
        return config

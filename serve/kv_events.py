"""Publishing the engine's KV cache events: vLLM's ZMQ wire format, and the same batches to gRPC subscribers.

The wire format is vLLM's (`vllm.distributed.kv_events`): each engine step's events are one `KVEventBatch`,
msgpack-encoded as msgspec encodes vLLM's structs: the batch as an array ``[ts, events, data_parallel_rank]``,
each event as a map tagged by its class name (``{"type": "BlockStored", "block_hashes": [...], ...}``, fields in
the struct's order, defaulted trailing fields left out where they hold their default). A PUB socket sends
``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian batch number; the optional ROUTER replay socket
answers ``(b"", start_seq)`` with ``(topic, seq, payload)`` for every buffered batch from ``start_seq`` and the
end marker ``(b"", -1, b"")``. Replica ``r`` of a ``-dp`` engine publishes on the endpoints' port + ``r``, as vLLM's
data-parallel ranks do.

The engine never waits for a subscriber: the engine thread only assigns the batch its sequence number and puts it
on a bounded queue (a full queue drops the batch and counts it: the gap in the sequence numbers tells the
subscriber to replay); a background thread encodes and sends, and the PUB socket drops what a subscriber that
does not read leaves beyond the high-water mark. pyzmq and msgpack are imported only when events are enabled.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_jax.config.kv_events import KVEventsConfig
from paged_jax.engine.data_parallel import DataParallelEngine
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.protocol import Engine
from paged_jax.kv_cache import KVCacheManager
from paged_jax.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventRecorder, KVEventBatch

from .proto.paged_jax.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_S = 0.05  # how often the publisher thread looks for replay requests while no batch arrives

_STORED_DEFAULTS = ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")


def event_to_wire(event: BlockStored | BlockRemoved | AllBlocksCleared) -> dict[str, Any]:
    """One event as msgspec encodes vLLM's tagged struct: the tag first, then the fields in order, fields with a
    default left out when they hold it (``omit_defaults``)."""
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        for name in _STORED_DEFAULTS:
            value = getattr(event, name)
            if value is not None:
                out[name] = [list(k) if k is not None else None for k in value] if name == "extra_keys" else value
        return out
    if isinstance(event, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
        if event.group_idx is not None:
            out["group_idx"] = event.group_idx
        return out
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch (vLLM's `KVEventBatch` layout, module docstring)."""
    import msgpack  # type: ignore[import-untyped]

    fields: list[Any] = [batch.ts, [event_to_wire(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        fields.append(batch.data_parallel_rank)
    return msgpack.packb(fields, use_bin_type=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-rank endpoint: tcp ports + rank (port 0 stays 0), inproc names + `_dp<rank>`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """One replica's PUB socket (plus the replay ROUTER), fed from a bounded queue by a background thread."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        import zmq

        self.config = config
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._next_seq = 0
        self.num_dropped = 0  # batches the full queue refused
        self.num_sent = 0
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        assert self.endpoint is not None
        self.endpoint = self._open(self._pub, self.endpoint, bind=_binds(self.endpoint))
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))  # a whole replay and its marker
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._open(self._replay, self.replay_endpoint, bind=True)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{rank}", daemon=True)

    @staticmethod
    def _open(sock, endpoint: str, bind: bool) -> str:
        """Bind or connect; a tcp port 0 binds a free port and returns the endpoint actually bound."""
        import zmq

        if not bind:
            sock.connect(endpoint)
            return endpoint
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ValueError(f"kv-events-config: cannot bind {endpoint}: {e}") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) if endpoint.endswith(":0") else endpoint

    def start(self) -> ZmqEventPublisher:
        self._thread.start()
        return self

    def publish(self, batch: KVEventBatch) -> int:
        """Queue `batch` (engine thread; never blocks) and return its sequence number; a full queue drops it."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("kv events: the publisher queue is full, %d batches dropped", self.num_dropped)
        return seq

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.exception("kv events: replay request failed")
            try:
                item = self._queue.get(timeout=REPLAY_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.num_sent += 1
            except Exception:  # noqa: BLE001 - one failed send must not stop the thread
                log.exception("kv events: publishing batch %d failed", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


@dataclass(slots=True)
class Subscription:
    """One gRPC subscriber: batches as (rank, seq, batch) on its asyncio queue; `lagged` once it fell more than
    `max_backlog` batches behind (its stream then ends: a gap it cannot see would corrupt its index)."""

    loop: asyncio.AbstractEventLoop
    max_backlog: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pushed: int = 0
    taken: int = 0
    lagged: bool = False

    def push(self, item: tuple[int, int, KVEventBatch]) -> None:
        if self.lagged:
            return
        if self.pushed - self.taken >= self.max_backlog:
            self.lagged = True
            item = None  # type: ignore[assignment]
        self.pushed += 1
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed
            self.lagged = True

    async def get(self) -> tuple[int, int, KVEventBatch] | None:
        """The next (rank, seq, batch); None once it lagged."""
        item = await self.queue.get()
        self.taken += 1
        return item


def replicas(engine: Engine) -> list[LLMEngine]:
    """Each replica of `engine`, in rank order."""
    if isinstance(engine, DataParallelEngine):
        return list(engine.replicas)
    assert isinstance(engine, LLMEngine), f"KV events need an LLMEngine, got {type(engine).__name__}"
    return [engine]


def lora_lookup(engine: LLMEngine) -> Callable[[tuple[str, ...]], tuple[int, str] | None] | None:
    """The (lora_int_id, name) of the adapter whose digest a request's extra hash keys name (`Sequence.prefix_keys`)."""
    adapters = engine.adapters
    if adapters is None:
        return None

    def lookup(keys: tuple[str, ...]) -> tuple[int, str] | None:
        digest = next((k.removeprefix("lora:") for k in keys if k.startswith("lora:")), None)
        return None if digest is None else adapters.find_digest(digest)

    return lookup


def attach(engine: Engine, config: KVEventsConfig) -> KVEventHub:
    """A hub recording every replica's cache changes, with its ZMQ publishers when `config` asks for them."""
    reps = replicas(engine)
    return KVEventHub([r.kv for r in reps], config, [lora_lookup(r) for r in reps])


class KVEventHub:
    """Records every replica's cache changes and hands each step's batch to the ZMQ publishers and gRPC subscribers.

    `flush` runs on the engine thread after each step, after a cache reset and while the engine is idle (a disk
    tier's files are written behind, after the step that computed them); `subscribe` on the event loop."""

    def __init__(
        self,
        managers: Sequence[KVCacheManager],
        config: KVEventsConfig | None,
        lora_lookups: Sequence[Callable[[tuple[str, ...]], tuple[int, str] | None] | None] = (),
    ) -> None:
        lookups = list(lora_lookups) or [None] * len(managers)
        self.recorders = [
            EventRecorder(m.page_size, m.groups, lora_lookup=lookup, data_parallel_rank=rank)
            for rank, (m, lookup) in enumerate(zip(managers, lookups, strict=True))
        ]
        self.managers = list(managers)
        for manager, recorder in zip(managers, self.recorders, strict=True):
            manager.set_observer(recorder)
        self.publishers = (
            [ZmqEventPublisher(config, rank).start() for rank in range(len(managers))]
            if config is not None and config.active
            else []
        )
        self._seqs = [0] * len(managers)
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()

    def flush(self) -> None:
        for rank, recorder in enumerate(self.recorders):
            self.managers[rank].poll_disk_tier()  # the disk tier's writes since the last flush
            batch = recorder.take()
            if batch is None:
                continue
            seq = self.publishers[rank].publish(batch) if self.publishers else self._next(rank)
            with self._lock:
                subs = list(self._subs)
            for sub in subs:
                sub.push((rank, seq, batch))

    def after_step(self, then: Callable[[Engine], None]) -> Callable[[Engine], None]:
        """An engine loop's `on_step` that runs `then` and publishes the step's events."""

        def on_step(engine: Engine) -> None:
            then(engine)
            self.flush()

        return on_step

    def _next(self, rank: int) -> int:
        seq = self._seqs[rank]
        self._seqs[rank] += 1
        return seq

    def subscribe(self, max_backlog: int) -> Subscription:
        sub = Subscription(asyncio.get_running_loop(), max_backlog)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close(self) -> None:
        for recorder in self.recorders:
            recorder.events.clear()
        for publisher in self.publishers:
            publisher.close()


def batch_to_pb(rank: int, seq: int, batch: KVEventBatch) -> pb.KVEventBatch:
    """One batch as the gRPC stream's message."""
    msg = pb.KVEventBatch(ts=batch.ts, sequence=seq, data_parallel_rank=rank)
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored = pb.BlockStored(
                block_hashes=event.block_hashes,
                token_ids=event.token_ids,
                block_size=event.block_size,
                medium=event.medium or "",
                group_idx=event.group_idx or 0,
                kv_cache_spec_kind=event.kv_cache_spec_kind or "",
                extra_keys=[pb.BlockExtraKeys(keys=k or ()) for k in event.extra_keys or ()],
            )
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            if event.lora_id is not None:
                stored.lora_id = event.lora_id
            if event.lora_name is not None:
                stored.lora_name = event.lora_name
            if event.kv_cache_spec_sliding_window is not None:
                stored.kv_cache_spec_sliding_window = event.kv_cache_spec_sliding_window
            msg.events.add(block_stored=stored)
        elif isinstance(event, BlockRemoved):
            removed = pb.BlockRemoved(
                block_hashes=event.block_hashes, medium=event.medium or "", group_idx=event.group_idx or 0
            )
            msg.events.add(block_removed=removed)
        else:
            msg.events.add(all_blocks_cleared=pb.AllBlocksCleared())
    return msg

"""The engine loop: one thread owns the engine; asyncio handlers talk to it through queues.

Handlers call `submit`, `abort` and `call` from the event loop; those only put a command on a
thread-safe queue. The loop thread drains every command before each engine step (so an abort frees a
request's pages before the next step runs), steps, and hands each request's output to its
`RequestStream` with `loop.call_soon_threadsafe` into a per-request `asyncio.Queue`.

A request that fails inside this bridge fails alone (INTERNAL, its pages freed through
`engine.fail`). An exception from `engine.step()` cannot be pinned on one request and leaves the
engine's state unknown: the loop then dies, every open stream ends with UNAVAILABLE at once, death
callbacks run (health turns NOT_SERVING, and `paged-jax serve` exits with a non-zero status so a
supervisor restarts it), and later submissions are refused with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from paged_jax.engine.input_processor import ProcessedRequest
from paged_jax.engine.protocol import Engine
from paged_jax.errors import FieldError
from paged_jax.lora.named import ServedAdapters
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.pooling_params import PoolingParams
from paged_jax.sampling_params import SamplingParams
from paged_jax.structured import Matcher
from paged_jax.tokenization.reasoning import Thought

from .config import Backpressure
from .convert import RequestError, internal_error

if TYPE_CHECKING:
    from .kv_events import KVEventHub

log = logging.getLogger(__name__)
STALL_CHECK_S = 0.05  # how often the loop looks for readers that read nothing for too long (`Backpressure`)


@dataclass(slots=True)
class Event:
    """One item for a request's stream: an engine output, or a terminal error status."""

    output: RequestOutput | None = None
    code: grpc.StatusCode | None = None
    message: str = ""  # why the request was aborted (with an output) or failed (with a code)
    field_error: FieldError | None = None  # the engine refused one field (INVALID_ARGUMENT), in its own words


class Inbox:
    """The events of one client request in arrival order, as (prompt index, Event) (the prompts of a multi-prompt
    request share one), and how far its reader is behind: `backlog` events pushed and not yet taken.

    `push` runs on the engine thread, `get` on the event loop; each counter has one writer. `read_at` is when the
    reader last took an event, or when an event arrived to an empty inbox (the stall clock starts then)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, backpressure: Backpressure | None = None) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.backpressure = backpressure or Backpressure()
        self.pushed = 0  # written by the engine thread only
        self.taken = 0  # written by the reader only
        self.read_at = time.monotonic()

    @property
    def backlog(self) -> int:
        return self.pushed - self.taken

    def push(self, index: int, event: Event) -> None:
        """Thread-safe; an inbox whose event loop has closed drops the event."""
        if self.pushed == self.taken:
            self.read_at = time.monotonic()
        self.pushed += 1
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, event))
        except RuntimeError:
            pass

    async def get(self) -> tuple[int, Event]:
        item = await self._queue.get()
        self.taken += 1
        self.read_at = time.monotonic()
        return item

    def stalled(self, now: float) -> str | None:
        """Why this inbox's requests must be aborted now (None: they may go on)."""
        bp, backlog = self.backpressure, self.backlog
        if bp.max_backlog is not None and backlog > bp.max_backlog:
            return f"aborted: the client fell {backlog} events behind reading the stream (limit {bp.max_backlog})"
        if bp.stall_timeout_s is not None and backlog > 0 and now - self.read_at > bp.stall_timeout_s:
            return f"aborted: the client read nothing for {bp.stall_timeout_s:g} s with {backlog} events waiting"
        return None


class RequestStream:
    """The asyncio side of one engine request: prompt `index` of its client request's `inbox`; `get` yields its
    events in order when the inbox is its own."""

    def __init__(self, request_id: str, inbox: Inbox, index: int = 0) -> None:
        self.request_id = request_id
        self.inbox, self.index = inbox, index
        self.started = False  # an output has arrived (the request left the waiting queue)

    def push(self, event: Event) -> None:
        self.inbox.push(self.index, event)

    async def get(self) -> Event:
        return (await self.inbox.get())[1]


@dataclass(slots=True)
class Submission:
    """One prompt of a client request, checked and tokenized, for `EngineLoop.submit_group`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    lora_request: LoRARequest | None = None
    thought: Thought | None = None  # the input processor's: a thinking model's reply (`ProcessedRequest.thought`)
    matchers: list[Matcher] | None = None  # structured outputs compiled on the front's thread
    pooling: PoolingParams | None = None  # an embedding request (`paged_jax.pooling_params`)


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    request: Submission
    group: str | None  # the client request's admission group (several prompts), None: its own


@dataclass(slots=True)
class _Abort:
    stream: RequestStream  # not the client's id: a stale abort must not end a new request that reuses it
    message: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


class EngineLoop:
    """Owns `engine` on a daemon thread. `on_step(engine)` runs after every step (metrics)."""

    def __init__(
        self, engine: Engine, on_step: Callable[[Engine], None] | None = None, idle_poll_s: float = 0.5
    ) -> None:
        self.engine = engine
        self.adapters = ServedAdapters()  # adapter names every front resolves (`ServingConfig.lora_modules`)
        self.kv_events: KVEventHub | None = None  # the prefix cache's changes, when published (serve.kv_events)
        self._on_step = on_step
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # open requests; guarded by _lock
        self._num_queued = 0  # open requests without an output yet; guarded by _lock
        self._death_callbacks: list[Callable[[BaseException], object]] = []
        self._checked_at = 0.0  # when `_abort_stalled` last looked
        self._stop = False
        self.error: BaseException | None = None  # set when the loop died
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- the asyncio side -----------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_queued(self) -> int:
        return self._num_queued

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def add_death_callback(self, fn: Callable[[BaseException], object]) -> None:
        """`fn(error)` runs on the loop thread if the loop dies (at once if it already has)."""
        with self._lock:
            if self.error is None:
                self._death_callbacks.append(fn)
                return
        fn(self.error)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        max_queued: int | None = None,
        lora_request: LoRARequest | None = None,
        backpressure: Backpressure | None = None,
        thought: Thought | None = None,
        matchers: list[Matcher] | None = None,
    ) -> RequestStream:
        """Register a request and queue it for the engine. Raises RequestError when it cannot be taken."""
        one = Submission(request_id, prompt_token_ids, params, cache_salt, lora_request, thought, matchers)
        return self.submit_group([one], max_queued, backpressure=backpressure)[0]

    def submit_group(
        self,
        submissions: list[Submission],
        max_queued: int | None = None,
        max_queued_share: float = 1.0,
        backpressure: Backpressure | None = None,
    ) -> list[RequestStream]:
        """Register one client request's prompts (taken whole or not at all) and queue them for the engine as one
        group: they share one turn of the scheduler's admission round-robin, so a many-prompt request does not
        hold back a one-prompt request behind it. Several prompts are taken only while the queue, with them, holds
        at most `max_queued_share` of `max_queued` (the rest stays open to others); one prompt needs one free slot.
        Their events arrive in one `Inbox` (`streams[i].index == i`), whose reader is held to `backpressure`.
        Raises RequestError (RESOURCE_EXHAUSTED when the queue has no room)."""
        inbox = Inbox(asyncio.get_running_loop(), backpressure)
        streams = [RequestStream(s.request_id, inbox, i) for i, s in enumerate(submissions)]
        k = len(submissions)
        group = submissions[0].request_id if k > 1 else None
        with self._lock:
            if self.error is not None or self._stop:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine: not running")
            for s in submissions:
                if s.request_id in self._streams:
                    raise RequestError(
                        grpc.StatusCode.ALREADY_EXISTS, f"request_id: {s.request_id!r} is already in use"
                    )
            if max_queued is not None:
                room = max_queued if k == 1 else int(max_queued * max_queued_share)
                if self._num_queued + k > room:
                    share = "" if k == 1 else f", {room} for requests of several prompts"
                    raise RequestError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"queue: {self._num_queued} requests already waiting (limit {max_queued}{share}); "
                        f"this request brings {k}",
                    )
            for s, stream in zip(submissions, streams, strict=True):
                self._streams[s.request_id] = stream
                self._num_queued += 1
                self._commands.put(_Add(stream, s, group))  # see _die
        return streams

    def abort(self, stream: RequestStream, message: str = "aborted") -> None:
        """Abort `stream`'s request before the next step; the stream (if still read) gets a final ABORT output.

        Keyed by the stream, not the client's request id: once this request has ended, its id may be reused
        by a new request, which this (then stale) abort leaves alone.
        """
        self._commands.put(_Abort(stream, message))

    def abort_all(self, message: str) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            self.abort(stream, message)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between two steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # _die sets `error` under the lock and then drains: no call is left behind
            if self.error is not None or not self._thread.is_alive():
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine: not running")
            self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after the current step (open requests are aborted)."""
        self._stop = True
        self._commands.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the loop thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        stalled = False  # the last step dispatched nothing and returned nothing
        try:
            while not self._stop:
                # Idle, or nothing could be scheduled: wait for a command (the only thing that changes the
                # engine's state then) instead of spinning on empty steps.
                self._drain(block=stalled or not engine.has_unfinished())
                if self._stop or not engine.has_unfinished():
                    if self.kv_events is not None:  # idle: publish what the disk tier wrote behind the last step
                        self.kv_events.flush()
                    continue
                launched = engine.num_launched
                outputs = engine.step()
                for out in outputs:
                    self._deliver(out)
                # A request waiting for its compile (the step waited a little for it) is work, not a stall.
                stalled = not outputs and engine.num_launched == launched and not engine.waiting_for_compiles
                self._abort_stalled()
                if self._on_step is not None:
                    self._on_step(engine)
            for rid in list(self._streams):
                self._abort(rid, "server stopped")
        except BaseException as e:  # noqa: BLE001 - the loop must report any death, then stop
            log.exception("engine loop died")
            self._die(e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                if self._streams.get(cmd.stream.request_id) is cmd.stream:  # else it has ended already
                    self._abort(cmd.stream.request_id, cmd.message)
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(self.engine))
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        cmd.future.set_exception(e)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        if self._streams.get(rid) is not cmd.stream:
            return  # aborted before it reached the engine
        r = cmd.request
        try:
            processed = ProcessedRequest(
                rid,
                None,
                r.prompt_token_ids,
                r.params,
                r.cache_salt,
                thought=r.thought,
                matchers=r.matchers,
                pooling=r.pooling,
            )
            self.engine.add_request(rid, processed, lora_request=r.lora_request, group=cmd.group)
        except ValueError as e:
            refused = e if isinstance(e, FieldError) else None
            self._close(rid, Event(code=grpc.StatusCode.INVALID_ARGUMENT, message=str(e), field_error=refused))
        except Exception as e:  # noqa: BLE001 - this request fails alone
            error = internal_error(f"add_request failed for {rid}: {type(e).__name__}: {e}", exc_info=True)
            self.engine.abort(rid)
            self._close(rid, Event(code=error.code, message=error.message))

    def _abort(self, request_id: str, message: str) -> None:
        out = self.engine.abort(request_id)
        if request_id in self._streams:
            self._close(
                request_id,
                Event(output=out, message=message)
                if out is not None
                else Event(code=grpc.StatusCode.CANCELLED, message=message),
            )

    def _abort_stalled(self) -> None:
        """Abort every open request whose client read nothing for its stall timeout while output waits
        (`Backpressure`; the backlog bound is checked as each event is delivered)."""
        now = time.monotonic()
        if now - self._checked_at < STALL_CHECK_S:
            return
        self._checked_at = now
        with self._lock:
            streams = list(self._streams.values())
        why: dict[int, str | None] = {}
        for stream in streams:
            inbox = stream.inbox
            if id(inbox) not in why:
                why[id(inbox)] = reason = inbox.stalled(now)
                if reason is not None:
                    self._abort_inbox(inbox, reason)

    def _abort_inbox(self, inbox: Inbox, why: str) -> None:
        """Abort every open request of `inbox`'s client request: the engine stops generating for them and their pages
        are freed; the inbox keeps what it holds until its handler ends."""
        with self._lock:
            rids = [rid for rid, s in self._streams.items() if s.inbox is inbox]
        for rid in rids:
            log.info("%s: %s", rid, why)
            self._abort(rid, why)

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            if not stream.started:
                stream.started = True
                with self._lock:
                    self._num_queued -= 1
            if out.error is not None:  # the engine failed this request alone (its pages are already free)
                error = internal_error(f"the engine failed {rid}: {out.error}")
                self._close(rid, Event(code=error.code, message=error.message))
            elif out.finished:
                self._close(rid, Event(output=out))
            else:
                stream.push(Event(output=out))
                bound = stream.inbox.backpressure.max_backlog
                if bound is not None and stream.inbox.backlog > bound:
                    why = stream.inbox.stalled(time.monotonic())
                    assert why is not None  # over the backlog bound
                    self._abort_inbox(stream.inbox, why)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            error = internal_error(f"delivering output of {rid} failed: {type(e).__name__}: {e}", exc_info=True)
            self.engine.fail(rid, str(e))
            self._close(rid, Event(code=error.code, message=error.message))

    def _close(self, request_id: str, event: Event) -> None:
        """Unregister a request and push its last event."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and not stream.started:
                self._num_queued -= 1
        if stream is not None:
            stream.started = True
            stream.push(event)

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self.error = error
            streams, self._streams, self._num_queued = list(self._streams.values()), {}, 0
            callbacks, self._death_callbacks = self._death_callbacks, []
        message = f"engine loop died: {type(error).__name__}: {error}"
        for stream in streams:
            stream.push(Event(code=grpc.StatusCode.UNAVAILABLE, message=message))
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call):
                cmd.future.set_exception(RequestError(grpc.StatusCode.UNAVAILABLE, message))
        for fn in callbacks:
            try:
                fn(error)
            except Exception:  # noqa: BLE001
                log.exception("death callback failed")

"""The OpenAI handlers: parse, submit to the shared engine loop, answer in one piece or as server-sent events.

One engine, one KV cache, one admission queue: requests go through the same `EngineLoop.submit_group` (and its
`max_queued_requests`) as gRPC's (a completions request's several prompts as one group, held to
`multi_prompt_queue_share` of the queue and taking one turn of admission together), are checked by the engine's
input processor as every front's are (its field names shown in OpenAI's words by `protocol.field_names`), and
are counted in the same Prometheus registry (method `OpenAI.Completions` / `OpenAI.ChatCompletions`, status as
gRPC's name).

A response starts only once the engine has taken the request (its first output), so every failure the
engine reports at admission still gets its HTTP status. Until then, and for a unary request until its end,
a watcher reads the connection: a client that goes away aborts its request at once (its pages are freed
before the next step). A streaming response is cancelled by Starlette when its client disconnects, and the
generator's `finally` aborts the request the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from paged_jax.engine.input_processor import ChatPrompt, ProcessedRequest
from paged_jax.errors import FieldError, FieldNames
from paged_jax.lora.named import AdapterNameTaken, UnknownAdapterError, check_adapter_name
from paged_jax.lora.peft import read_adapter
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.tokenization.tool_calls import (
    FORMATS,
    ToolFormat,
    function_specs,
    reads_tools,
    tool_format,
    with_tool_prompt,
)
from paged_jax.worker.warmup import WarmupProgress

from .. import convert
from ..config import ServingConfig
from ..convert import RequestError
from ..engine_loop import EngineLoop, Event, Inbox, RequestStream, Submission
from ..metrics import Metrics
from . import tokenize
from .body import read_body
from .errors import error_body, error_response
from .protocol import Kind, OpenAIRequest, field_names, json_value, parse_body, typed
from .responses import Echo, ResponseBuilder

CPU_WORKERS = 2  # threads for JSON parsing, tokenization and chat templates, off the event loop
METHODS = {"completion": "OpenAI.Completions", "chat": "OpenAI.ChatCompletions"}
T = TypeVar("T")


@dataclass(slots=True)
class Run:
    """A request the engine has taken: what `finals` and `chunks` read its outputs with."""

    req: OpenAIRequest
    streams: list[RequestStream]
    firsts: list[tuple[int, Event]]  # each prompt's first event (the engine took it)
    builder: ResponseBuilder
    n: int  # samples per prompt
    names: FieldNames  # the engine's field names in this request's words


class OpenAIFront:
    """The state the routes share: the engine loop, limits, metrics, and the draining flag."""

    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics) -> None:
        self.loop, self.config, self.metrics = loop, config, metrics
        engine = loop.engine
        # The names the model answers to (`--served-model-name`); replies carry the first.
        self.model_names: tuple[str, ...] = config.served_model_names or (engine.config.name,)
        self.model_name: str = self.model_names[0]
        self.tokenizer = engine.tokenizer
        self.inputs = convert.serving_inputs(engine, config.limits)
        self.draining = False  # set on shutdown: new generations get 503
        self.ready: Callable[[], bool] = lambda: True  # False while the server warms up (/health 503 meanwhile)
        self.warmup: Callable[[], WarmupProgress | None] = lambda: None  # the server's warm-up, when it runs one
        self._cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="openai-cpu")

    # -- checks ---------------------------------------------------------------------------------------
    def check_auth(self, request: Request, exempt: bool = False) -> None:
        """UNAUTHENTICATED (401) unless the request carries `Authorization: Bearer <token>` (when auth is on)."""
        expected = self.config.auth_token
        if expected is None or (exempt and self.config.auth_exempt_health):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), expected.encode())  # constant time, whatever the scheme
        if not (ok and scheme.lower() == "bearer"):
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization: a valid 'Bearer <token>' is required")

    def health(self) -> str | None:
        """None while serving, else why not (draining, the engine loop died, warming up)."""
        if self.draining:
            return "draining"
        if not self.loop.alive:
            return "engine not running"
        if self.ready():
            return None
        progress = self.warmup()
        return "warming up" + (f" ({progress.describe()})" if progress is not None else "")

    # -- generation ---------------------------------------------------------------------------------
    def _adapter(self, req: OpenAIRequest) -> LoRARequest | None:
        return self._model(req.model)

    def _model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); NOT_FOUND naming it when nothing is served so."""
        if model is None or model in self.model_names:
            return None
        try:
            return self.loop.adapters.get(model)
        except UnknownAdapterError:
            served = [*self.model_names, *self.loop.adapters.names()]
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"model: {model!r} is not served here (GET /v1/models lists {', '.join(map(repr, served))})",
                "model",
            ) from None

    def _convert(self, req: OpenAIRequest) -> tuple[ToolFormat | None, list[ProcessedRequest]]:
        """Each prompt checked by the input processor (limits, tokenizing or the chat template, SamplingParams),
        and the tool-call format its replies are parsed with."""
        self._adapter(req)
        fmt = self._tool_choice(req)
        try:
            parsed = [self.inputs.process(g) for g in req.generates]
            self.inputs.check_size(parsed)
            return fmt, parsed
        except FieldError as e:
            raise convert.field_error(e, field_names(req.kind, req.max_tokens_name, req.structured_param)) from None

    def _tool_choice(self, req: OpenAIRequest) -> ToolFormat | None:
        """The tool-call format replies are parsed with (None: plain text), from the chat template's family; a
        forced `tool_choice` ("required" or a named function) becomes the grammar of a call."""
        if req.kind != "chat" or not req.tools or req.tool_choice == "none":
            return None
        template = self.tokenizer.chat_template
        fmt = tool_format(template, self.loop.engine.engine_config.tool_call_parser)
        forced = req.tool_choice != "auto"
        if fmt is None and not reads_tools(template) and template is not None:
            fmt = FORMATS["hermes"]  # the generic form: the tools described in a system message
            for g in req.generates:
                assert isinstance(g.prompt, ChatPrompt)  # a chat request's prompt
                g.prompt.messages = with_tool_prompt(g.prompt.messages, req.tools)
        if fmt is None:
            if forced:
                raise convert.invalid(
                    "tool_choice: the model's chat template reads tools but is in no tool-call family this server "
                    "parses (--tool-call-parser names one), so a forced call could not be returned as tool_calls",
                    "tool_choice",
                )
            return None
        if forced:
            if req.structured_param is not None:
                raise convert.invalid(
                    f"tool_choice: a forced call cannot be combined with {req.structured_param}", "tool_choice"
                )
            functions = function_specs(req.tools)
            if isinstance(req.tool_choice, dict):
                name = req.tool_choice["function"]["name"]
                functions = {name: functions[name]}
            constraint = fmt.grammar(functions)  # one call (of any tool, or of the named one)
            for g in req.generates:
                assert isinstance(g.sampling, dict)  # parse_body gives each prompt its fields by name
                g.sampling["structured_outputs"] = constraint
        return fmt

    def _echoes(self, parsed: list[ProcessedRequest]) -> list[Echo]:
        """Each prompt as echo repeats it: its text as given, a token-id prompt's decoded (special tokens kept)."""

        def text(p: ProcessedRequest) -> str:
            return p.prompt if p.prompt is not None else self.tokenizer.decode(p.prompt_token_ids, False)

        return [Echo(text(p), p.prompt_token_ids) for p in parsed]

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def generate(self, request: Request, kind: Kind) -> Response:
        """POST /v1/completions and /v1/chat/completions."""
        method, streams = METHODS[kind], []
        try:
            self.check_auth(request)
            raw = await read_body(request, self.config.limits.max_body_bytes)
            req = await self._off_loop(parse_body, raw, kind, self.inputs.limits.max_chat_messages)
            run = await self.start(request, req)
            streams = run.streams
            if req.stream:
                return _EventStream(self._sse(run), lambda: self._abort(run.streams))
            outs = await self.finals(request, run)
            self._count(method, grpc.StatusCode.OK)
            return JSONResponse(run.builder.full(outs, run.n))
        except RequestError as e:
            self._abort(streams)  # a no-op for requests that have ended
            self._count(method, e.code)
            return error_response(e.code, e.message, param="model" if e.code == grpc.StatusCode.NOT_FOUND else e.field)
        except Exception as e:  # noqa: BLE001 - this request fails alone, in OpenAI's shape, its pages freed
            self._abort(streams, "failed")
            error = convert.internal_error(f"{method} failed: {type(e).__name__}: {e}", exc_info=True)
            self._count(method, error.code)
            return error_response(error.code, error.message)

    async def start(self, request: Request, req: OpenAIRequest) -> Run:
        """Check a parsed request, submit it as one group (admitted whole or not at all, one turn of admission for
        all its prompts; structured outputs compiled on this front's thread, `serving_inputs`), and wait until the
        engine has taken every prompt. A failure aborts what was submitted and raises RequestError. The Responses
        route (`responses_api.py`) runs its translated chat requests through here too."""
        fmt, parsed = await self._off_loop(self._convert, req)
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server: shutting down")
        kind = req.kind
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        lora = self._adapter(req)
        ids = [rid if len(parsed) == 1 else f"{rid}-{i}" for i in range(len(parsed))]
        submissions = [
            Submission(i, p.prompt_token_ids, p.params, p.cache_salt, lora, p.thought, p.matchers)
            for i, p in zip(ids, parsed, strict=True)
        ]
        streams = self.loop.submit_group(
            submissions,
            self.config.max_queued_requests,
            self.config.multi_prompt_queue_share,
            self.config.backpressure,
        )
        try:
            model = self.model_name if lora is None else lora.lora_name
            echo = await self._off_loop(self._echoes, parsed) if req.echo else None
            thought = parsed[0].thought if kind == "chat" else None
            builder = ResponseBuilder(
                kind, rid, model, self.tokenizer, req.logprobs, fmt, thought, echo, req.prompt_logprobs
            )
            names = field_names(kind, req.max_tokens_name, req.structured_param)
            # every prompt's events, in arrival order
            firsts = await self._unless_disconnected(request, streams, _firsts(streams[0].inbox, len(streams), names))
        except BaseException:
            self._abort(streams)
            raise
        return Run(req, streams, firsts, builder, parsed[0].params.n, names)

    async def finals(self, request: Request, run: Run) -> list[RequestOutput]:
        """Each prompt's final output, in prompt order (the request aborted if the client leaves first)."""
        work = _finals(run.streams[0].inbox, run.firsts, len(run.streams), run.names)
        outs = await self._unless_disconnected(request, run.streams, work)
        for out in outs:
            self.metrics.on_finished(out)
        return outs

    def _abort(self, streams: list[RequestStream], message: str = "cancelled: the client disconnected") -> None:
        for stream in streams:
            self.loop.abort(stream, message)

    async def _unless_disconnected(self, request: Request, streams: list[RequestStream], work: Awaitable[T]) -> T:
        """`await work`, unless the client disconnects first: then abort the requests (CANCELLED)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            gone = not task.done()  # the client went away (or this handler was cancelled)
            if gone:
                task.cancel()
                task.add_done_callback(_retrieve)  # else asyncio logs an ERROR with a traceback per hang-up
                self._abort(streams)
        if gone:
            raise RequestError(grpc.StatusCode.CANCELLED, "cancelled: the client disconnected")
        return task.result()

    async def chunks(self, run: Run) -> AsyncIterator[dict[str, Any]]:
        """A started request's stream chunks as outputs arrive (prompt i's sample j as choice i * n + j), after a
        chat's role chunk, and the usage chunk if asked for; an engine failure raises RequestError. Events are
        taken from the inbox only as the consumer reads (a chunk is yielded, and sent, before the next is taken),
        so a client that stops reading shows as the inbox's backlog, which the engine loop bounds
        (`Backpressure`)."""
        req, builder, n = run.req, run.builder, run.n
        usage_field = {"usage": None} if req.include_usage else {}
        ended: set[int] = set()  # choices whose chunk with the finish reason went out
        inbox, replay = run.streams[0].inbox, list(run.firsts)
        finished: list[RequestOutput] = []
        if req.kind == "chat":
            yield {**builder.role_chunk(n), **usage_field}
        while len(finished) < len(run.streams):
            i, event = replay.pop(0) if replay else await inbox.get()
            if event.code is not None:
                raise _event_error(event, run.names)
            out = event.output
            assert out is not None  # an event without a code carries an output
            builder.seen(i, out)
            for c in out.outputs:
                index = i * n + c.index
                if c.new_token_ids or c.new_text or (c.finished and index not in ended):
                    if c.finished:
                        ended.add(index)
                    for chunk in builder.delta_chunks(c, offset=i * n, prompt=i):
                        yield {**chunk, **usage_field}
            if out.finished:
                finished.append(out)
                self.metrics.on_finished(out)
        if req.include_usage:
            yield builder.usage_chunk(finished)

    async def _sse(self, run: Run) -> AsyncIterator[str]:
        """The event stream: `chunks` as `data:` lines, then `data: [DONE]`; an error after the response started
        is the last event (as vLLM does)."""
        method, status, done = METHODS[run.req.kind], grpc.StatusCode.OK, False
        try:
            async for chunk in self.chunks(run):
                yield _data(chunk)
            done = True
        except RequestError as e:
            status = e.code
            yield _data(error_body(e.code, e.message, e.field)[1])
        except Exception as e:  # noqa: BLE001 - this request fails alone; the cause goes to the log
            error = convert.internal_error(f"{method} stream failed: {type(e).__name__}: {e}", exc_info=True)
            status = error.code
            yield _data(error_body(error.code, error.message)[1])
        except BaseException:  # cancelled (the client went away) or closed early
            status = grpc.StatusCode.CANCELLED
            raise
        finally:
            if not done:
                self._abort(run.streams)  # a no-op for those that have ended
            self._count(method, status)
        yield "data: [DONE]\n\n"

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        self.metrics.requests.labels(method, code.name).inc()

    # -- the tokenizer routes (vLLM's) ----------------------------------------------------------------
    async def tokenize(self, request: Request) -> JSONResponse:
        """POST /tokenize (`tokenize.py` has the shapes)."""
        self.check_auth(request)
        body = _json_object(await read_body(request, self.config.limits.max_body_bytes))
        req = tokenize.parse_tokenize(body)
        self._model(req.model)

        def run() -> dict[str, Any]:
            try:
                return tokenize.tokenize(req, self.inputs)
            except FieldError as e:  # the chat template's refusals, in this route's words
                raise convert.field_error(e, FieldNames()) from None

        return JSONResponse(await self._off_loop(run))

    async def detokenize(self, request: Request) -> JSONResponse:
        """POST /detokenize {"tokens": [...]} -> {"prompt": text}."""
        self.check_auth(request)
        body = _json_object(await read_body(request, self.config.limits.max_body_bytes))
        self._model(typed(body, "model", str))
        return JSONResponse(await self._off_loop(tokenize.detokenize, body, self.inputs))

    def tokenizer_info(self, request: Request) -> JSONResponse:
        """GET /tokenizer_info."""
        self.check_auth(request)
        return JSONResponse(tokenize.tokenizer_info(self.inputs))

    # -- the rest -------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """The base model under each served name, then every served LoRA adapter as its own model with the base
        as `parent`."""
        engine = self.loop.engine
        base = {"object": "model", "created": 0, "owned_by": "paged-jax", "max_model_len": engine.max_model_len}
        adapters = [self.loop.adapters.get(name) for name in self.loop.adapters.names()]
        return {
            "object": "list",
            "data": [
                *({"id": name, **base, "root": self.model_name, "parent": None} for name in self.model_names),
                *({"id": a.lora_name, **base, "root": a.lora_path, "parent": self.model_name} for a in adapters),
            ],
        }

    async def load_adapter(self, request: Request) -> JSONResponse:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"}: read the adapter now (INVALID_ARGUMENT naming
        what is wrong with it) and serve it under its name. The name is held while the adapter is read
        (`ServedAdapters.reserve`), so a name served or being loaded is ALREADY_EXISTS (HTTP 409) at once and
        of concurrent loads of one new name exactly one succeeds."""
        self.check_auth(request)
        body = _json_object(await read_body(request, self.config.limits.max_body_bytes))
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: must be a non-empty string", "lora_path")
        try:
            name = check_adapter_name(name)
            if name in self.model_names:
                raise AdapterNameTaken(name)
            self.loop.adapters.reserve(name)
        except AdapterNameTaken as e:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, str(e), "lora_name") from None
        except FieldError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        config = self.loop.engine.config
        max_rank = self.loop.engine.engine_config.max_lora_rank
        try:
            await self._off_loop(read_adapter, path, name, config, max_rank)  # refused here, not at first use
        except FieldError as e:
            self.loop.adapters.release(name)
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {e.message}", "lora_path") from None
        except BaseException:
            self.loop.adapters.release(name)
            raise
        self.loop.adapters.add(name, path)
        return JSONResponse({"status": "ok", "lora_name": name})

    async def reset_prefix_cache(self, request: Request) -> JSONResponse:
        """POST /reset_prefix_cache (vLLM's): drop every cached prefix block (KV event subscribers get
        `AllBlocksCleared`); FAILED_PRECONDITION while requests run, whose blocks must stay."""
        self.check_auth(request)
        hub = self.loop.kv_events

        def reset(engine) -> bool:  # on the engine thread, like a step: its AllBlocksCleared is published at once
            done = engine.reset_prefix_cache()
            if hub is not None:
                hub.flush()
            return done

        if not await self.loop.call(reset):
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "prefix cache: requests are running; reset it when the server is idle",
            )
        return JSONResponse({"status": "ok"})

    async def unload_adapter(self, request: Request) -> JSONResponse:
        """POST /v1/unload_lora_adapter {"lora_name"}: stop serving it (requests already running finish)."""
        self.check_auth(request)
        body = _json_object(await read_body(request, self.config.limits.max_body_bytes))
        name = body.get("lora_name")
        try:
            self.loop.adapters.remove(name if isinstance(name, str) else "")
        except UnknownAdapterError as e:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"lora_name: {e}", "lora_name") from None
        return JSONResponse({"status": "ok", "lora_name": name})


def _json_object(raw: bytes) -> dict[str, Any]:
    body = json_value(raw)
    if not isinstance(body, dict):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "body: must be a JSON object")
    return body


class _EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends (a client that left before the
    first chunk leaves the generator unstarted, so its own `finally` never runs). Once the request has ended
    the abort is a no-op: the engine loop keys it by the stream, not by a reusable id."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _firsts(inbox: Inbox, k: int, names: FieldNames) -> list[tuple[int, Event]]:
    """The inbox's events until each of its `k` prompts has had one (the engine took them all), in arrival order;
    a prompt the engine refused raises its RequestError."""
    events: list[tuple[int, Event]] = []
    seen: set[int] = set()
    while len(seen) < k:
        i, event = await inbox.get()
        if event.code is not None:
            raise _event_error(event, names)
        events.append((i, event))
        seen.add(i)
    return events


async def _finals(inbox: Inbox, firsts: list[tuple[int, Event]], k: int, names: FieldNames) -> list[RequestOutput]:
    """Each of the `k` prompts' final output, in prompt order (reading the inbox on from `firsts`)."""
    finals: dict[int, RequestOutput] = {}
    for i, e in firsts:  # events without a code (`_firsts` raised the others): each carries an output
        assert e.output is not None
        if e.output.finished:
            finals[i] = e.output
    while len(finals) < k:
        i, event = await inbox.get()
        if event.code is not None:
            raise _event_error(event, names)
        assert event.output is not None  # an event without a code carries an output
        if event.output.finished:
            finals[i] = event.output
    return [finals[i] for i in range(k)]


def _retrieve(future: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen: a gather whose children were cancelled finishes with their
    CancelledError as its exception, which asyncio reports as "never retrieved" (an ERROR) when collected."""
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body is already read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _event_error(event: Event, names: FieldNames) -> RequestError:
    """The RequestError of a request the engine ended with an error status (a refused field in `names`' words)."""
    if event.field_error is not None:
        return convert.field_error(event.field_error, names)
    assert event.code is not None  # called for the events that end a request with a status
    return RequestError(event.code, event.message)


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

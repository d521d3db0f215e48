"""The GenerationService handlers: validate, submit to the engine loop, stream the outputs back.

Cancellation, a missed deadline and a dropped connection all cancel the handler's task; its
`finally` then asks the engine loop to abort the request, which frees its pages before the next step.

Every handler runs on the one asyncio event loop that also serves every stream and health check, so
anything that costs CPU in proportion to the request (tokenizing, detokenizing, range-checking ids)
runs on a small thread pool, and only after the input's size has been checked against its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc import aio

from paged_jax.engine.protocol import Engine
from paged_jax.lora.named import UnknownAdapterError

from . import convert, embed_rpc
from .config import ServingConfig
from .convert import InvalidRequest, ParsedRequest, RequestError, invalid
from .engine_loop import EngineLoop, Event, RequestStream, Submission
from .kv_events import batch_to_pb
from .metrics import Metrics
from .proto.paged_jax.v1 import generate_pb2 as pb

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
CPU_WORKERS = 2  # threads for tokenization and validation, off the event loop
T = TypeVar("T")


class GenerationServicer:
    def __init__(self, loop: EngineLoop, config: ServingConfig, metrics: Metrics) -> None:
        self.loop, self.config, self.metrics = loop, config, metrics
        engine: Engine = loop.engine
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.config.vocab_size
        self.max_model_len, self.max_n = engine.max_model_len, engine.max_n
        self.sampling_defaults = dict(engine.engine_config.sampling_defaults)
        self.inputs = convert.serving_inputs(engine, config.limits)
        self.draining = False  # set on shutdown: new generations get UNAVAILABLE
        self._cpu = ThreadPoolExecutor(CPU_WORKERS, thread_name_prefix="serve-cpu")

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the CPU pool, so the event loop keeps serving streams and health checks."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    # -- generation ---------------------------------------------------------------------------------
    def _parse(self, request: pb.GenerateRequest | InvalidRequest) -> ParsedRequest:
        if isinstance(request, InvalidRequest):
            raise invalid(request.message)
        return convert.parse_generate(request, self.inputs)

    def _submit(self, parsed: ParsedRequest) -> RequestStream:
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server: shutting down")
        rid = parsed.request_id or f"req-{uuid.uuid4().hex}"
        lora = None
        if parsed.lora_name is not None:
            try:
                lora = self.loop.adapters.get(parsed.lora_name)
            except UnknownAdapterError as e:
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"lora_name: {e}") from None
        return self.loop.submit(
            rid,
            parsed.prompt_token_ids,
            parsed.params,
            parsed.cache_salt,
            self.config.max_queued_requests,
            lora,
            self.config.backpressure,
            parsed.thought,
            parsed.matchers,
        )

    async def _events(self, stream: RequestStream) -> AsyncIterator[Event]:
        """The stream's events until its last; aborts the request if the consumer stops early."""
        done = False
        try:
            while True:
                event = await stream.get()
                if event.code is not None:
                    done = True
                    raise RequestError(event.code, event.message)
                assert event.output is not None  # an event without a code carries an output
                done = event.output.finished
                yield event
                if done:
                    return
        finally:
            if not done:
                self.loop.abort(stream, "cancelled by the client")

    @contextlib.asynccontextmanager
    async def _outcome(self, method: str, context: aio.ServicerContext) -> AsyncIterator[None]:
        """One generation's ending: a RequestError becomes its status; any other failure is INTERNAL for this
        request alone; the status is counted in the metrics either way."""
        status = grpc.StatusCode.OK
        try:
            yield
        except RequestError as e:
            status = e.code
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # noqa: BLE001 - this request fails alone
            if isinstance(e, aio.AbortError):
                raise
            status = grpc.StatusCode.INTERNAL
            error = convert.internal_error(f"{method} failed: {type(e).__name__}: {e}", exc_info=True)
            await context.abort(error.code, error.message)
        finally:
            self.metrics.requests.labels(method, status.name).inc()

    async def Generate(self, request, context: aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        async with self._outcome("Generate", context):
            parsed = await self._off_loop(self._parse, request)
            stream = self._submit(parsed)
            mode, rid, split = parsed.output_mode, stream.request_id, parsed.reply_split()
            ended: set[int] = set()  # samples whose last chunk (with its finish reason) went out
            async for event in self._events(stream):
                out = event.output
                assert out is not None  # `_events` raises the events with a code
                for c in out.outputs:
                    if c.new_token_ids or c.new_text or (c.finished and c.index not in ended):
                        if c.finished:
                            ended.add(c.index)
                        yield pb.GenerateResponse(request_id=rid, chunk=convert.chunk(c, mode, split))
                if out.finished:
                    self.metrics.on_finished(out)
                    yield pb.GenerateResponse(request_id=rid, final=convert.final(out, event.message))

    async def GenerateUnary(self, request, context: aio.ServicerContext) -> pb.GenerateUnaryResponse:
        async with self._outcome("GenerateUnary", context):
            parsed = await self._off_loop(self._parse, request)
            stream = self._submit(parsed)
            async for event in self._events(stream):
                assert event.output is not None  # `_events` raises the events with a code
                if event.output.finished:
                    self.metrics.on_finished(event.output)
                    return convert.unary(event.output, parsed.output_mode, event.message, parsed.reply_split())
            raise RequestError(grpc.StatusCode.INTERNAL, "engine: the request ended without a final output")

    async def Embed(self, request, context: aio.ServicerContext) -> pb.EmbedResponse:
        """Embeddings pooled as /v1/embeddings pools them (`serve.embed_rpc`), the inputs submitted as one group."""
        async with self._outcome("Embed", context):
            if isinstance(request, InvalidRequest):
                raise invalid(request.message)
            parsed = await self._off_loop(embed_rpc.parse_embed, request, self.loop.engine, self.inputs)
            if self.draining:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "server: shutting down")
            rid = parsed[0].request_id or f"embd-{uuid.uuid4().hex}"
            submissions = [
                Submission(rid if len(parsed) == 1 else f"{rid}-{i}", p.prompt_token_ids, p.params, p.cache_salt,
                           pooling=p.pooling)
                for i, p in enumerate(parsed)
            ]  # fmt: skip
            config = self.config
            streams = self.loop.submit_group(
                submissions, config.max_queued_requests, config.multi_prompt_queue_share, config.backpressure
            )
            finals: dict[int, Any] = {}
            try:
                while len(finals) < len(streams):
                    i, event = await streams[0].inbox.get()
                    if event.code is not None:
                        raise RequestError(event.code, event.message)
                    assert event.output is not None  # an event without a code carries an output
                    if event.output.finished:
                        finals[i] = event.output
                        self.metrics.on_finished(event.output)
            finally:
                for i, stream in enumerate(streams):
                    if i not in finals:
                        self.loop.abort(stream, "cancelled by the client")
            return embed_rpc.response([finals[i] for i in range(len(streams))], rid)

    # -- the rest -------------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context: aio.ServicerContext) -> pb.ModelInfo:
        engine, lim = self.loop.engine, self.config.limits
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return pb.ModelInfo(
            name=engine.config.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            page_size=engine.engine_config.page_size,
            num_pages=engine.num_pages - 1,
            kv_capacity_tokens=(engine.num_pages - 1)
            * engine.engine_config.page_size
            * engine.engine_config.data_parallel_size,
            eos_token_ids=list(
                dict.fromkeys((*engine.config.eos_token_ids, *getattr(self.tokenizer, "eos_token_ids", ())))
            ),
            bos_token_id=bos,
            max_prompt_tokens=self.inputs.max_prompt_tokens,
            max_tokens_limit=lim.max_tokens,
            max_n=min(lim.max_n, self.max_n),
            max_stop_strings=lim.max_stop_strings,
            max_stop_string_chars=lim.max_stop_string_chars,
            chat_template_source=getattr(getattr(self.tokenizer, "chat_template", None), "source", ""),
            generation_defaults=[
                pb.SamplingDefault(field=k, value=float(v)) for k, v in self.sampling_defaults.items()
            ],
        )

    async def Tokenize(self, request, context: aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            if isinstance(request, InvalidRequest):
                raise invalid(request.message)
            convert.check_text_length("text", request.text, self.inputs.max_prompt_tokens or self.max_model_len)
        except RequestError as e:
            await context.abort(e.code, e.message)
        add = (
            request.add_special_tokens
            if request.HasField("add_special_tokens")
            else request.add_bos
            if request.HasField("add_bos")
            else True
        )
        ids = await self._off_loop(lambda: self.tokenizer.encode(request.text, add_special_tokens=add))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context: aio.ServicerContext) -> pb.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        spaces = request.spaces_between_special_tokens if request.HasField("spaces_between_special_tokens") else True

        def decode() -> str:
            ids = convert.check_token_ids("token_ids", request.token_ids, self.vocab_size)
            return self.tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)

        try:
            if isinstance(request, InvalidRequest):
                raise invalid(request.message)
            if len(request.token_ids) > self.max_model_len:  # no sequence of this model is longer
                raise invalid(
                    f"token_ids: {len(request.token_ids)} ids, more than max_model_len ({self.max_model_len})"
                )
            text = await self._off_loop(decode)
        except RequestError as e:
            await context.abort(e.code, e.message)
        return pb.DetokenizeResponse(text=text)

    async def GetStats(self, request, context: aio.ServicerContext) -> pb.Stats:
        check = not isinstance(request, InvalidRequest) and request.check_invariants
        if check and not self.config.allow_invariant_checks:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "check_invariants: not allowed on this server "
                "(it stalls the engine; start the server with --allow-invariant-checks)",
            )

        def read(engine: Engine) -> pb.Stats:
            s = engine.stats()
            msg = pb.Stats(
                pages_total=s.pages_total,
                pages_free=s.pages_free,
                pages_in_use=s.pages_in_use,
                pages_cached_free=s.pages_cached_free,
                kv_utilization=s.slot_utilization,
                prefix_hit_rate=s.prefix_hit_rate,
                num_preemptions=s.num_preemptions,
                num_waiting=s.num_waiting,
                num_running=s.num_running,
                num_open_requests=self.loop.num_open,
                num_steps=engine.num_steps,
            )
            if check:
                try:
                    engine.check_invariants()
                    msg.invariants_ok = True
                except (AssertionError, RuntimeError) as e:
                    msg.invariants_error = str(e) or "assertion failed"
            return msg

        try:
            return await self.loop.call(read)
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def StreamKVEvents(self, request, context: aio.ServicerContext) -> AsyncIterator[pb.KVEventBatch]:
        """Every batch of KV events from now on (`serve.kv_events`), until the client leaves or falls behind."""
        hub = self.loop.kv_events
        if hub is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "kv events: not enabled on this server (start it with --kv-events-config "
                "'{\"enable_kv_cache_events\": true}')",
            )
            return
        sub = hub.subscribe(self.config.max_stream_backlog)
        try:
            while True:
                item = await sub.get()
                if item is None:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"kv events: the subscriber fell {self.config.max_stream_backlog} batches behind; subscribe "
                        "again (and rebuild the index from a cache reset or the ZMQ replay)",
                    )
                    return
                yield batch_to_pb(*item)
        finally:
            hub.unsubscribe(sub)


def generic_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """Method handlers with `lenient_deserializer`, so a bad message reaches the handler as InvalidRequest."""
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = (
            grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=convert.lenient_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)

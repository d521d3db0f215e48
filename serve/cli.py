"""The arguments and bodies of `paged-jax serve` and `paged-jax client` (registered in `serve.main`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from paged_jax.config.kv_events import KVEventsConfig
from paged_jax.errors import UsageError

from .config import ServingConfig, ServingLimits
from .event_loop import loop_factory
from .ports import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, PortInUseError, Ports, check_ports_free, resolve_ports

API_KEY_ENV = ("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY")  # read in this order


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`paged-jax serve [MODEL]`, shaped like `vllm serve`: the model as the positional argument, the OpenAI
    API on `--port`, gRPC on `--grpc-port`."""
    from paged_jax.engine.args import MODEL_HELP, add_engine_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=f"the model: {MODEL_HELP}")
    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address of every port (0.0.0.0: all interfaces)")
    g.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"the OpenAI-compatible HTTP API, as vLLM's --port (default: {DEFAULT_HTTP_PORT}; 0 picks a free port)",
    )
    g.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help=f"the gRPC API (default: {DEFAULT_GRPC_PORT}; 0 picks a free port)",
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the old spelling of --port; `--port G --http-port H` without --grpc-port keeps its old meaning "
        "(gRPC on G, HTTP on H)",
    )
    g.add_argument("--no-http", action="store_true", help="serve gRPC only")
    add_distributed_args(parser)
    g.add_argument("--no-grpc", action="store_true", help="serve the HTTP API only")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients use in `model` (the first is the one replies carry; default: the model's name, "
        "for a Hugging Face id the id)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="the bearer token clients must send (default: $PAGED_JAX_API_KEY, $PAGED_JAX_AUTH_TOKEN or "
        "$VLLM_API_KEY; none: no auth)",
    )
    g.add_argument("--auth-token-file", default=None, help="a file holding the bearer token (instead of --api-key)")
    g.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint (default: off)")
    g.add_argument("--metrics-host", default="127.0.0.1", help="bind address of --metrics-port")
    g.add_argument(
        "--metrics-auth",
        action="store_true",
        help="require the bearer token on HTTP /metrics and on the metrics port too (default: they are open)",
    )
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain (with --tls-key: TLS on both APIs)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--max-queued-requests", type=int, default=256, help="requests accepted but not yet started")
    g.add_argument(
        "--multi-prompt-queue-share",
        type=float,
        default=0.5,
        help="requests of several prompts may fill the queue up to this share of --max-queued-requests",
    )
    g.add_argument(
        "--front-nice",
        type=int,
        default=0,
        help="niceness (0-19) added to the request fronts' threads and the background warm-up, so the engine's "
        "steps run first where cores are short (0: off)",
    )
    g.add_argument(
        "--max-stream-backlog",
        type=int,
        default=256,
        help="a stream whose client has more events (steps' tokens) unread is aborted",
    )
    g.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds a stream's client may read nothing while output waits before the request is aborted",
    )
    g.add_argument(
        "--http-send-timeout",
        type=float,
        default=60.0,
        help="seconds before the kernel closes an HTTP connection whose sent data stays unread (TCP_USER_TIMEOUT)",
    )
    g.add_argument(
        "--allow-invariant-checks",
        action="store_true",
        help="let GetStats(check_invariants=true) run the KV invariant checker (stalls the engine)",
    )
    g.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    g.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's changes as vLLM's KV events, vLLM's JSON: e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/user/scaling_out.md)',
    )
    d = ServingLimits()
    lim = parser.add_argument_group("request limits (a request beyond one is refused, naming the field)")
    lim.add_argument(
        "--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="prompt tokens (0: the model's length)"
    )
    lim.add_argument("--max-tokens-limit", type=int, default=d.max_tokens, help="the largest max_tokens accepted")
    lim.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="max_tokens of a request that sets none and whose model sets none (default: as vLLM, the rest of the "
        "context for a conversation, 16 for a plain prompt; both capped by --max-tokens-limit)",
    )
    lim.add_argument("--max-n", type=int, default=d.max_n, help="samples per prompt (n)")
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="stop strings per request")
    lim.add_argument(
        "--max-stop-string-chars", type=int, default=d.max_stop_string_chars, help="characters of one stop string"
    )
    lim.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="bytes of one gRPC message")
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="bytes of one HTTP body, checked before it is parsed (larger: 413)",
    )
    lim.add_argument("--max-chat-messages", type=int, default=d.max_chat_messages, help="messages in one conversation")
    lim.add_argument(
        "--max-request-tokens",
        type=int,
        default=d.max_request_tokens,
        help="prompts x n x max_tokens one request may ask for",
    )
    lim.add_argument(
        "--max-logprob-entries",
        type=int,
        default=d.max_logprob_entries,
        help="logprob entries (tokens x (1 + alternatives)) one response may hold",
    )


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Multi-host serving (`serve.multihost`): the same command on every process of the job."""
    g = parser.add_argument_group("multi-host (one server over every process's devices; serve.multihost)")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="join a JAX multi-controller job (on a TPU slice it finds the other hosts itself): process 0 serves, "
        "every process runs each step over the global mesh (tensor parallelism across hosts)",
    )
    g.add_argument("--coordinator-address", default=None, help="host:port of process 0 (implies --distributed)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job (default: found by JAX)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index (default: found by JAX)")
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=30.0,
        help="seconds without a follower's heartbeat before process 0 stops the server",
    )


def check_distributed_args(args: argparse.Namespace) -> None:
    """What multi-host serving does not run (yet): one line naming the flag."""
    if args.distributed_timeout <= 0:
        raise UsageError(f"--distributed-timeout: must be > 0, got {args.distributed_timeout:g}")
    clashes = {
        "--data-parallel-size": (args.data_parallel_size or 1) > 1,
        "--enable-lora / --lora-modules": bool(args.enable_lora or args.lora_modules),
        "--speculative-config": bool(getattr(args, "speculative_config", None)),
        "--kv-host-cache-gib": bool(getattr(args, "kv_host_cache_gib", 0)),
        "--kv-disk-cache-dir": bool(getattr(args, "kv_disk_cache_dir", None)),
    }
    for flag, on in clashes.items():
        if on:
            raise UsageError(f"{flag}: not supported with --distributed (one replica, one host tier-less cache)")


def api_key(args: argparse.Namespace) -> str | None:
    """The bearer token: --api-key, --auth-token-file, else the first of `API_KEY_ENV` that is set."""
    if args.api_key is not None and args.auth_token_file:
        raise UsageError("--api-key, --auth-token-file: give one of them")
    if args.api_key is not None:
        if not args.api_key.strip():
            raise UsageError("--api-key: is empty; leave it out to serve without auth")
        return args.api_key.strip()
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"--auth-token-file: {args.auth_token_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
        if not token:
            raise UsageError(f"--auth-token-file: {args.auth_token_file} is empty")
        return token
    for name in API_KEY_ENV:
        value = os.environ.get(name)
        if value is not None:
            if not value.strip():  # set but empty: a mistake, never "no auth"
                raise UsageError(f"{name}: is set but empty; unset it to serve without auth")
            return value.strip()
    return None


# ServingConfig fields whose flag is not `--<field>`
_SERVING_FLAGS = {
    "port": "--grpc-port",
    "http_port": "--port",
    "auth_token": "--api-key",
    "tls_cert_file": "--tls-cert",
    "stream_stall_timeout_s": "--stream-stall-timeout",
    "http_send_timeout_s": "--http-send-timeout",
    "grace_period_s": "--grace-period",
    "max_tokens": "--max-tokens-limit",
}


def serving_config_from_args(args: argparse.Namespace, ports: Ports | None = None) -> ServingConfig:
    """The ServingConfig of the flags, validated: UsageError naming the flag."""
    from paged_jax.lora.named import parse_lora_modules

    ports = ports or resolve_ports(args)
    limits = ServingLimits(
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens=args.max_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        max_n=args.max_n,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_message_bytes=args.max_message_bytes,
        max_body_bytes=args.max_body_bytes,
        max_chat_messages=args.max_chat_messages,
        max_request_tokens=args.max_request_tokens,
        max_logprob_entries=args.max_logprob_entries,
    )
    names = tuple(args.served_model_name or ())
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        raise UsageError(f"--served-model-name: names must be non-empty and distinct, got {list(names)}")
    config = ServingConfig(
        kv_events=kv_events_config(args.kv_events_config),
        host=args.host,
        port=ports.grpc,
        http_port=ports.http,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_auth=args.metrics_auth,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        auth_token=api_key(args),
        max_queued_requests=args.max_queued_requests,
        multi_prompt_queue_share=args.multi_prompt_queue_share,
        max_stream_backlog=args.max_stream_backlog,
        front_nice=args.front_nice,
        stream_stall_timeout_s=args.stream_stall_timeout,
        http_send_timeout_s=args.http_send_timeout,
        allow_invariant_checks=args.allow_invariant_checks,
        grace_period_s=args.grace_period,
        limits=limits,
        lora_modules=tuple(parse_lora_modules(args.lora_modules)),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        served_model_names=names,
    )
    try:
        config.validate()
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        flag = _SERVING_FLAGS.get(field, "--" + field.replace("_", "-"))
        raise UsageError(f"{flag}: {why}" if why else str(e)) from None
    return config


def kv_events_config(text: str | None) -> KVEventsConfig | None:
    """`--kv-events-config`: vLLM's JSON object, validated (UsageError naming the field)."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--kv-events-config: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--kv-events-config: expected a JSON object, got {type(raw).__name__}")
    try:
        config = KVEventsConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--kv-events-config: {e}") from None
    missing = [m for m in ("zmq", "msgpack") if config.active and importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"--kv-events-config: the zmq publisher needs {' and '.join(missing)}: pip install 'paged-jax[kv-events]'"
        )
    return config


def model_arg(args: argparse.Namespace) -> str:
    """The model of `paged-jax serve MODEL` (or `--model`); UsageError when none or two different ones."""
    from paged_jax.engine.args import MODEL_HELP

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise UsageError(f"--model: {args.model!r} and the positional MODEL {args.model_tag!r} differ; give one")
    model = args.model_tag or args.model
    if model is None:
        raise UsageError(f"MODEL is required (paged-jax serve MODEL): {MODEL_HELP}")
    return model


def run_serve(args: argparse.Namespace) -> int:
    """Check every flag and both ports, load the model, serve until SIGTERM. A bad flag, a port in use or a
    model that cannot be found is a UsageError (one line, exit status 2) before anything loads. With
    --distributed the same command runs on every process; process 0 serves (`serve.multihost`)."""
    from paged_jax.engine.args import build_engine, check_model_text_args, engine_config_from_args, setup_logging
    from paged_jax.lora.named import check_lora_modules
    from paged_jax.model.loader.resolve import resolve_model

    from .server import serve_forever

    distributed = args.distributed or args.coordinator_address is not None
    if distributed:
        check_distributed_args(args)
    args.model = model_arg(args)
    ports = resolve_ports(args)
    config = serving_config_from_args(args, ports)
    engine_config_from_args(args)  # flags checked before the model loads
    check_model_text_args(args)
    resolve_model(args.model)  # found, or one line saying why not
    leader = None
    if distributed:  # before anything touches a JAX backend
        from . import multihost

        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id, args.distributed_timeout)
        if jax_process_index() != 0:
            setup_logging()
            engine = build_engine(args, warmup=False, devices=global_devices())
            multihost.check_same_cache(engine.num_pages)
            warm = None
            if not args.no_warmup:  # the shapes process 0 compiles, compiled here meanwhile
                from . import follower_warmup

                warm = follower_warmup.start(engine)
            status = multihost.follow(engine.runner)
            if warm is not None:
                warm.report()
            end_process(status)
    check_ports_free(config.host, ports)
    setup_logging()
    if ports.note:
        print(f"paged-jax serve: note: {ports.note}", file=sys.stderr)

    def stop_during_startup(signum, frame) -> None:
        if leader is not None:
            leader.close()
        end_process(0)  # nothing is serving yet, so there is nothing to drain

    previous = signal.signal(signal.SIGTERM, stop_during_startup)  # until serve_forever installs its own
    try:
        # Loading can take minutes; warm-up runs while listening, and no step waits for a compile.
        devices = global_devices() if distributed else None
        engine = build_engine(args, warmup=False, background_compiles=True, devices=devices)
        if distributed:
            multihost.check_same_cache(engine.num_pages)
            leader = multihost.Leader(engine.runner, args.distributed_timeout, on_lost=_follower_lost)
            engine = multihost.LeaderEngine(engine, leader)
        try:  # every --lora-modules adapter read now (and handed to the engine's cache), not on first use
            adapters = check_lora_modules(config.lora_modules, engine.config, engine.engine_config.max_lora_rank)
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            serving = serve_forever(engine, config, not args.no_warmup, adapters)
            status = asyncio.run(serving, loop_factory=loop_factory())
        except PortInUseError as e:  # taken since the check: the engine's threads are running, end them all
            print(f"paged-jax serve: error: {e}", file=sys.stderr)
            end_process(2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if leader is not None:
        leader.close()
    end_process(status)


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def global_devices() -> list:
    """Every process's devices, in JAX's order (the global mesh of multi-host serving)."""
    import jax

    return jax.devices()


def _follower_lost(message: str) -> None:
    """Process 0's watchdog: a follower is gone and the steps cannot go on (the engine thread may be parked in a
    collective that never completes), so the server ends now with the engine-died status."""
    from .server import EXIT_ENGINE_DIED

    logging.getLogger("serve.multihost").error("%s: stopping the server", message)
    print(f"paged-jax serve: error: {message}", file=sys.stderr)
    end_process(EXIT_ENGINE_DIED)


def end_process(status: int) -> NoReturn:
    """End the serving process with `status` without running the interpreter's finalization.

    By the time this is called everything the server started has been stopped and joined on purpose (the
    drain, the gRPC and HTTP servers, the engine loop, the warm-up compiles), or nothing has started yet
    (SIGTERM while the model loads). What finalization would add is tearing down gRPC's aio core and
    XLA's thread pools in an undefined order while their native threads may still be parked in them, a
    known source of crashes at exit (grpc/grpc#40447): a CI run saw a clean SIGTERM during warm-up end with
    status -11. Logs and standard streams are flushed first, so nothing written is lost."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to lose
            pass
    os._exit(status)


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    parser.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message, rendered with the model's chat template"
    )
    parser.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    parser.add_argument("--target", default="127.0.0.1:50051", help="the server's gRPC address (--grpc-port)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the model's)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the model's)")
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (default: the model's)")
    parser.add_argument("--seed", type=int, default=None, help="the request's sampling seed (default: none)")
    parser.add_argument("--n", type=int, default=None, help="samples to stream, [i]-prefixed (default: 1)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--tls-ca", default=None, help="PEM root certificate(s) to trust (turns TLS on)")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    parser.add_argument(
        "--token", default=os.environ.get("PAGED_JAX_AUTH_TOKEN"), help="bearer token (default: $PAGED_JAX_AUTH_TOKEN)"
    )


def run_client(args: argparse.Namespace) -> int:
    """Stream the completion to stdout (sample i > 0 prefixed with [i]); usage and timing to stderr."""
    import grpc

    from .client import Client, chat_input

    roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    sampling = {
        k: v
        for k, v in dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            n=args.n,
        ).items()
        if v is not None
    }
    with Client(args.target, token=args.token, root_certificates=roots, tls=args.tls) as client:
        try:
            prompt = args.prompt
            if args.chat:
                messages = [{"role": "system", "content": args.system}] if args.system is not None else []
                prompt = chat_input([*messages, {"role": "user", "content": args.prompt}])
            for resp in client.generate_stream(prompt, timeout=args.timeout, stop=args.stop, **sampling):
                if resp.HasField("chunk"):
                    c = resp.chunk
                    sys.stdout.write(c.text if c.index == 0 else f"[{c.index}]{c.text}")
                    sys.stdout.flush()
                else:
                    f = resp.final
                    reasons = ",".join(pb_finish_name(s.finish_reason) for s in f.samples)
                    print(
                        f"\n[{reasons}] prompt {f.usage.prompt_tokens} tokens ({f.usage.cached_tokens} cached), "
                        f"generated {f.usage.completion_tokens}, ttft {f.timing.time_to_first_token_s * 1e3:.1f} ms"
                        + (f", {f.message}" if f.message else ""),
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def pb_finish_name(value: int) -> str:
    from .proto.paged_jax.v1 import generate_pb2 as pb

    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()

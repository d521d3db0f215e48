"""Load test: bounded concurrent streams for a bounded time against a loopback `paged-jax serve` server.

    .venv/bin/python scripts/bench/load_test.py --concurrency 256 --duration 60
    .venv/bin/python scripts/bench/load_test.py --http ...   # the same mix through the OpenAI HTTP front

With `--http` the streams go to `/v1/completions` (stream: true) through the official `openai` client,
a cancelled one by closing its connection mid-stream; the end-of-run page check still uses gRPC GetStats.

Starts the server as a subprocess (unless --target is given), keeps `--concurrency` streams open for
`--duration` seconds (each finished stream is replaced by a new one), cancels a tenth of them at a
random point, then reports requests/s, tokens/s, TTFT p50/p99, errors by status code, whether every
KV page is free at the end (stats RPC + invariant check), and the server's RSS over the run.

    .venv/bin/python scripts/bench/load_test.py --soak 180   # soak mode: both fronts, a hostile mix, pass/fail goals

`--soak SECONDS` starts the tiny model (or --model) with the gRPC and the OpenAI HTTP front (a chat template for
the tiny byte tokenizer), waits until the background warm-up has finished, then for SECONDS keeps these clients
busy: normal completions and chats (unary, streamed, multi-prompt, n=2; a tenth of the streams cancelled
mid-stream) on HTTP and gRPC, hostile requests (a sample of tests/hostile/test_hostile_serve.py's bodies: 100k-deep
nesting, 5,000-digit integers, lone surrogates, template-global shadowing, bad fields, wrong methods; and bad gRPC
`tools_json` / `chat_template_kwargs_json`), clients that hang up before or after the first byte, and SSE clients
that never read (the server's stall timeout must end them). It prints one table: requests by outcome, p50/p99
latency of the normal requests, server RSS 10 s in and at the end, pages in use once the last stream is gone,
compiles after warm-up (the server's /metrics counters), server log lines at ERROR, and the goals pass/fail (0
HTTP 5xx, 0 gRPC INTERNAL, 0 compiles, RSS growth < 5%, every page free); the exit status is 1 when one fails.

`--soak-mix full` (issue 41) adds the surfaces added since: auth on (every client sends the bearer token, the
server runs with `--api-key`); LoRA (two adapters loaded and unloaded at runtime under traffic through
`/v1/load_lora_adapter`, requests naming them, hostile loads: unsafe names, missing paths, a taken name);
structured output (small valid regex / JSON-schema constraints beside hostile ones: nested counted repetitions
in a regex and a schema `pattern`, 3,000-deep JSON strings, a grammar over the size limit); tool calls
(declared tools with `tool_choice: auto`, so the parser reads every reply; 5,000-deep history arguments);
prompt logprobs and logprobs. The traffic starts as soon as the server reports SERVING, during the background
warm-up (RSS and compiles are then counted from the warm-up's end). `--soak-ngram` adds n-gram speculation in
the same server (a constrained request then decodes without drafts beside the speculating ones).

The victims are the normal completions and chats: their latency p50/p99 over the requests sent after the
background warm-up ended is the table's "victim latency" row. `--soak-clean` runs the same server with the
victims' clients alone; `--soak-compare` runs a clean soak, then the asked-for one (each its own server, the same
length), prints both tables and the ratio of their victim p99s (goal: within 2x; the exit status is 1 past it).

`--victim` (issue 41's isolation table) starts the same server as `--soak-mix full`, waits for its background
warm-up, then times a victim's unconstrained 64-token greedy completion alone and beside each attack of
`VICTIM_ATTACKS` (one attack request sent with the victim, as the issue measured it; with `--victim-flood N`, N
clients resending it until the victim is done), 3 rounds each, and prints the median seconds and the ratio to
alone (goal: within 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h11
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.serve.client import build_request  # noqa: E402
from paged_jax.serve.proto.paged_jax.v1 import generate_pb2 as pb  # noqa: E402
from paged_jax.serve.proto.paged_jax.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

EXPECTED = {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}  # cancelled by us; queue full under overload
HTTP_CODES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 400: "INVALID_ARGUMENT", 500: "INTERNAL"}
WORDS = "the a paged attention cache of tokens in jax serving stream model request page block".split()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, ServerLog]:
    cmd = [
        sys.executable,
        "-m",
        "serve",
        "serve",
        "--model",
        args.model,
        "--grpc-port",
        "0",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-queued-requests",
        str(args.max_queued),
        "--grace-period",
        "5",
        "--allow-invariant-checks",
    ]
    cmd += ["--port", "0"] if args.http or args.soak else ["--no-http"]
    workdir = Path(tempfile.mkdtemp(prefix="paged-jax-soak-")) if args.soak else None
    if workdir is not None:
        template = workdir / "chat.jinja"
        template.write_text(SOAK_TEMPLATE)
        cmd += ["--chat-template", str(template)]
    if args.num_pages:
        cmd += ["--num-pages", str(args.num_pages)]
    if workdir is not None and args.soak_mix == "full":
        from paged_jax.config import load_model_config
        from paged_jax.lora.random_adapter import write_adapter

        config = load_model_config(args.model.removesuffix("-instruct"))  # the architecture's shapes
        args.adapters = [write_adapter(workdir / f"adapter-{i}", config, rank=8, seed=i, std=0.05) for i in range(2)]
        args.token = "soak-" + os.urandom(8).hex()
        cmd += ["--api-key", args.token, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
        cmd += ["--enable-lora-runtime-updates"]
        if args.soak_ngram:  # constrained requests decode without drafts beside the speculating ones
            cmd += ["--speculative-config", json.dumps(NGRAM)]
    if args.soak and args.front_nice:
        cmd += ["--front-nice", str(args.front_nice)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    target = None
    for line in proc.stdout:
        if m := re.search(r"serving \S+ on (\S+:\d+)", line):
            target = m.group(1)
        if m := re.search(r"OpenAI API on (\S+)", line):
            args.base_url = m.group(1)
        if target is not None and (args.base_url or not (args.http or args.soak)):
            return proc, target, ServerLog(proc.stdout, workdir and workdir / "server.log")
    raise SystemExit(f"server exited with {proc.wait()}")


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


class BearerToken(aio.UnaryUnaryClientInterceptor, aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every gRPC call (the soak's server runs with --api-key)."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def _with_token(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.metadata)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class Load:
    def __init__(self, stub: pb_grpc.GenerationServiceStub, args: argparse.Namespace) -> None:
        self.stub, self.args = stub, args
        self.codes: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.tokens = 0
        self.done = 0
        self.http = None  # an openai.AsyncOpenAI client in --http mode
        self.model = ""

    async def one(self, rng: random.Random) -> None:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        req = build_request(
            prompt,
            max_tokens=rng.randint(8, self.args.max_tokens),
            temperature=rng.random(),
            seed=rng.randrange(2**31),
            ignore_eos=rng.random() < 0.5,
        )
        cancel_after = rng.randint(1, 20) if rng.random() < 0.1 else None
        start, chunks = time.perf_counter(), 0
        call = self.stub.Generate(req, timeout=120)
        try:
            async for resp in call:
                if resp.HasField("chunk"):
                    if chunks == 0:
                        self.ttft.append(time.perf_counter() - start)
                    chunks += 1
                    self.tokens += len(resp.chunk.token_ids)
                    if cancel_after is not None and chunks >= cancel_after:
                        call.cancel()
                        break
            self.codes["CANCELLED" if call.cancelled() else "OK"] += 1
        except asyncio.CancelledError:
            self.codes["CANCELLED"] += 1
        except grpc.RpcError as e:
            self.codes[e.code().name] += 1
        self.done += 1

    async def one_http(self, rng: random.Random) -> None:
        """The same request mix through /v1/completions; a cancellation closes the connection mid-stream."""
        import openai

        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))
        cancel_after = rng.randint(1, 20) if rng.random() < 0.1 else None
        start, chunks, stream = time.perf_counter(), 0, None
        try:
            stream = await self.http.completions.create(
                model=self.model,
                prompt=prompt,
                max_tokens=rng.randint(8, self.args.max_tokens),
                stream=True,
                temperature=rng.random(),
                seed=rng.randrange(2**31),
                logprobs=0,
                extra_body={"ignore_eos": rng.random() < 0.5},
            )
            cancelled = False
            async for chunk in stream:
                if chunks == 0:
                    self.ttft.append(time.perf_counter() - start)
                chunks += 1
                self.tokens += sum(len(c.logprobs.tokens) for c in chunk.choices)
                if cancel_after is not None and chunks >= cancel_after:
                    cancelled = True
                    break
            self.codes["CANCELLED" if cancelled else "OK"] += 1
        except openai.APIStatusError as e:
            self.codes[HTTP_CODES.get(e.status_code, f"HTTP_{e.status_code}")] += 1
        except openai.APITimeoutError:
            self.codes["DEADLINE_EXCEEDED"] += 1
        except openai.APIConnectionError:
            self.codes["UNAVAILABLE"] += 1
        finally:
            if stream is not None:
                await stream.close()
        self.done += 1

    async def worker(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        one = self.one_http if self.http is not None else self.one
        while time.monotonic() < until:
            await one(rng)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace, target: str, pid: int | None) -> dict:
    async with aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        health = health_pb2_grpc.HealthStub(channel)  # the server warms up in the background: wait for SERVING
        while (
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        ).status != health_pb2.HealthCheckResponse.SERVING:
            await asyncio.sleep(0.1)
        load, rss = Load(stub, args), []
        if args.http:
            import openai  # its default pool (1000 connections) is above any concurrency used here

            load.http = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
            load.model = info.name
        start = time.monotonic()
        until = start + args.duration

        async def sample_rss() -> None:
            while time.monotonic() < until:
                rss.append(rss_mib(pid))
                await asyncio.sleep(1.0)

        cpu_start = cpu_s(pid) if pid is not None else None
        tasks = [asyncio.create_task(load.worker(i, until)) for i in range(args.concurrency)]
        if pid is not None:
            tasks.append(asyncio.create_task(sample_rss()))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
        cpu = cpu_s(pid) - cpu_start if pid is not None else None
        if load.http is not None:
            await load.http.close()
        stats = None
        for _ in range(100):  # every page back once the last stream is gone
            stats = await stub.GetStats(pb.GetStatsRequest(check_invariants=True), timeout=30)
            if stats.num_open_requests == 0 and stats.pages_in_use == 0:
                break
            await asyncio.sleep(0.05)
    return dict(load=load, elapsed=elapsed, stats=stats, rss=rss, cpu=cpu)


# -- soak mode (--soak SECONDS): both fronts, a mix of good, cancelled, abandoned and hostile requests ----------

# A chat template for the tiny model (its byte tokenizer has none); `n` feeds range(), as in
# tests/hostile/test_hostile_serve.py
SOAK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if n is defined %}{% for i in range(n) %}.{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
_CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
# A sample of tests/hostile/test_hostile_serve.py's bodies (most were once an HTTP 500), as (method, path, body):
# every answer must be a 4xx
HOSTILE_HTTP: dict[str, tuple[str, str, bytes]] = {
    "nested-100k": ("POST", "/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "digits-max_tokens": ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"7" * 5000 + b"}"),
    "temperature-10**400": ("POST", "/v1/completions", b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}"),
    "temperature-NaN": ("POST", "/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    "surrogate-prompt": ("POST", "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}'),
    "surrogate-stop": ("POST", "/v1/completions", b'{"prompt": "a", "stop": ["x", "\\udfff"]}'),
    "surrogate-content": ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    "surrogate-tools": (
        "POST",
        "/v1/chat/completions",
        _CHAT + b', "tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}',
    ),
    "digits-in-tools": (
        "POST",
        "/v1/chat/completions",
        _CHAT
        + b', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": '
        + b"7" * 5000
        + b"}}}]}",
    ),
    "shadow-range": ("POST", "/v1/chat/completions", _CHAT + b', "chat_template_kwargs": {"range": 1}}'),
    "range-too-big": ("POST", "/v1/chat/completions", _CHAT + b', "chat_template_kwargs": {"n": 1000000000000}}'),
    "bad-type": ("POST", "/v1/completions", b'{"prompt": "a", "temperature": "hot"}'),
    "negative-max_tokens": ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": -1}'),
    "too-much-output": ("POST", "/v1/completions", b'{"prompt": ["a", "b"], "n": 16, "max_tokens": 4096}'),
    "no-messages": ("POST", "/v1/chat/completions", b'{"messages": []}'),
    "not-json": ("POST", "/v1/completions", b'{"prompt": "a",'),
    "unknown-model": ("POST", "/v1/completions", b'{"model": "nope", "prompt": "a"}'),
    "GET-completions": ("GET", "/v1/completions", b""),
    "HEAD-chat": ("HEAD", "/v1/chat/completions", b""),
    "OPTIONS-completions": ("OPTIONS", "/v1/completions", b""),
}
_HISTORY_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}],
}
# The surfaces issue 41 added (structured output, tool calls, adapters): every answer must be a 4xx
HOSTILE_HTTP_NEW: dict[str, tuple[str, str, bytes]] = {
    "regex-nested-repeats": (
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "a", "n": 16, "structured_outputs": {"regex": "(a{700}){700}"}}).encode(),
    ),
    "pattern-nested-repeats": (
        "POST",
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a{1000}){1000}"}},
                },
            }
        ).encode(),
    ),
    "json-string-nested": (
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "a", "structured_outputs": {"json": "[" * 3000 + "]" * 3000}}).encode(),
    ),
    "grammar-too-big": (
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "a", "structured_outputs": {"grammar": 'start: "a"\n' + "// x\n" * 20_000}}).encode(),
    ),
    "tool-arguments-nested": (
        "POST",
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}, _HISTORY_CALL], "max_tokens": 2}).encode(),
    ),
    "lora-name-unsafe": ("POST", "/v1/load_lora_adapter", b'{"lora_name": "../x", "lora_path": "/tmp"}'),
    "lora-path-missing": ("POST", "/v1/load_lora_adapter", b'{"lora_name": "nope", "lora_path": "/nonexistent"}'),
    "lora-config-nested": ("POST", "/v1/load_lora_adapter", b'{"lora_name": "x", "lora_path": ' + b"[" * 5000 + b"}"),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
_DEEP = "[" * 100_000 + "]" * 100_000
# gRPC chat fields that were INTERNAL: (tools_json, chat_template_kwargs_json); every answer must be INVALID_ARGUMENT
HOSTILE_GRPC: dict[str, tuple[str, str]] = {
    "tools-nested-100k": (_DEEP, ""),
    "tools-surrogate": ('[{"type": "function", "function": {"name": "\\ud800"}}]', ""),
    "tools-digits": (
        '[{"type": "function", "function": {"name": "f", "parameters": {"maximum": ' + "7" * 5000 + "}}}]",
        "",
    ),
    "kwargs-shadow-namespace": ("", '{"namespace": 1}'),
    "kwargs-surrogate": ("", '{"n": "\\ud800"}'),
}
# What a never-reading SSE client asks for: far more output than the socket buffers hold
UNREAD = {"prompt": "a", "max_tokens": 1500, "n": 4, "logprobs": 5, "ignore_eos": True, "stream": True}


@dataclass
class SoakResult:
    """What one soak measured; `soak_report` turns it into the table and the verdict."""

    seconds: float
    outcomes: Counter[str]  # "HTTP 200", "HTTP 400", "gRPC OK", "transport: ConnectionResetError", ...
    latencies_s: list[float]  # normal requests that completed, request sent to last byte
    victim_s: list[float]  # of those, the normal completions and chats sent after the background warm-up ended
    ttft_s: list[float]  # normal streams, request sent to first token
    client_errors_500: int  # 5xx answers to any request
    grpc_internal: int  # INTERNAL / UNKNOWN / DATA_LOSS answers
    rss_start_mib: float  # 10 s into the soak (warm-up finished before it started)
    rss_end_mib: float
    pages_in_use: int
    pages_total: int
    open_requests: int
    invariants: str  # "ok" or the checker's error
    compiles_after_warmup: float  # the server's paged_jax_compiles_after_warmup_total at the end
    compiles_during_soak: float  # paged_jax_compiles_total, end minus start
    error_log_lines: int  # server log lines at ERROR level or tracebacks
    load_average: str
    during_warm_up: bool = False  # the traffic started during the background warm-up (compiles counted from its end)
    max_open_requests: int = 0  # the server's open requests (queued, running, finishing), sampled each second
    max_waiting: int = 0  # of those, in the scheduler's waiting queue
    hostile_answers: Counter[str] = field(default_factory=Counter)  # "case -> status": shown below the table
    examples: dict[int, str] = field(default_factory=dict)  # the first error body of each HTTP status


def soak_goals(r: SoakResult) -> dict[str, bool]:
    """The issue's goals, each pass/fail."""
    return {
        "0 HTTP 5xx": r.client_errors_500 == 0,
        "0 gRPC INTERNAL": r.grpc_internal == 0,
        # traffic during the background warm-up (the full mix) compiles what it needs ahead of the warm-up, which
        # the server counts as after warm-up: the goal is then 0 compiles once the background warm-up is over
        "0 compiles after warm-up": (r.compiles_after_warmup == 0 or r.during_warm_up) and r.compiles_during_soak == 0,
        "RSS growth < 5% after the first 10 s": r.rss_end_mib < 1.05 * r.rss_start_mib,
        "every page free at the end": r.pages_in_use == 0 and r.open_requests == 0 and r.invariants == "ok",
    }


def soak_report(r: SoakResult) -> tuple[str, bool]:
    """The soak's table (markdown) and whether every goal passed."""
    rows = [("requests", f"{sum(r.outcomes.values())} in {r.seconds:.0f} s")]
    rows += [(f"outcome {k}", str(v)) for k, v in sorted(r.outcomes.items())]
    rows += [
        (
            "latency of normal requests (completed)",
            f"p50 {pct(r.latencies_s, 0.5) * 1e3:.0f} ms, p99 {pct(r.latencies_s, 0.99) * 1e3:.0f} ms "
            f"({len(r.latencies_s)} requests)",
        ),
        (
            "victim latency (normal requests sent after the warm-up)",
            f"p50 {pct(r.victim_s, 0.5) * 1e3:.0f} ms, p99 {pct(r.victim_s, 0.99) * 1e3:.0f} ms "
            f"({len(r.victim_s)} requests)",
        ),
        (
            "TTFT of normal streams",
            f"p50 {pct(r.ttft_s, 0.5) * 1e3:.0f} ms, p99 {pct(r.ttft_s, 0.99) * 1e3:.0f} ms",
        ),
        (
            "server RSS (10 s in -> end)",
            f"{r.rss_start_mib:.0f} -> {r.rss_end_mib:.0f} MiB ({(r.rss_end_mib / r.rss_start_mib - 1) * 100:+.1f}%)",
        ),
        (
            "pages in use at the end",
            f"{r.pages_in_use} of {r.pages_total}, open requests {r.open_requests}, invariants {r.invariants}",
        ),
        (
            "compiles after warm-up",
            f"{r.compiles_after_warmup:.0f} (paged_jax_compiles_after_warmup_total); "
            f"{r.compiles_during_soak:.0f} compiled during the soak"
            + (" after the background warm-up" if r.during_warm_up else ""),
        ),
        ("server open requests, max (sampled each second)", f"{r.max_open_requests} ({r.max_waiting} waiting)"),
        ("server log lines at ERROR / tracebacks", str(r.error_log_lines)),
        ("load average (1, 5, 15 min) at the end", r.load_average),
    ]
    goals = soak_goals(r)
    rows += [(f"goal: {name}", "pass" if ok else "FAIL") for name, ok in goals.items()]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|---|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines), all(goals.values())


def _sse_events(buffer: bytearray) -> list[bytes]:
    """Complete server-sent events taken off the front of `buffer` (each one's `data:` payload)."""
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        block, buffer[:] = bytes(buffer[:end]), buffer[end + 2 :]
        events += [line[5:].strip() for line in block.split(b"\n") if line.startswith(b"data:")]
    return events


class Soak:
    """Workers of each kind share one counter of outcomes; each kind runs in a loop until `until`."""

    def __init__(
        self, stub: pb_grpc.GenerationServiceStub, host: str, port: int, until: float, token: str | None = None
    ) -> None:
        self.stub, self.host, self.port, self.until, self.token = stub, host, port, until, token
        self.adapters: list[Path] = []  # --soak-mix full: adapter directories the LoRA clients load
        self.metadata = () if token is None else (("authorization", f"Bearer {token}"),)  # streams: explicit
        self.lora_lock = asyncio.Lock()
        self.outcomes: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.victims: list[tuple[float, float]] = []  # normal requests: (time.monotonic() when sent, seconds)
        self.ttft: list[float] = []
        self.hostile_answers: Counter[str] = Counter()  # "case -> status"
        self.examples: dict[int, str] = {}  # the first error body seen for each HTTP status

    async def http(
        self,
        method: str,
        path: str,
        body: bytes,
        on_event: Callable[[bytes], bool] | None = None,
    ) -> tuple[int, bytes] | None:
        """One HTTP/1.1 exchange (h11 on a fresh connection). With `on_event`, the 200 body is read as server-sent
        events, each passed to it; it returns False to hang up. Returns (status, body), None when we hung up;
        a transport failure is counted and returned as None."""
        conn = h11.Connection(h11.CLIENT)
        headers = [("Host", self.host), ("Connection", "close"), ("Content-Length", str(len(body)))]
        if self.token is not None:
            headers.append(("Authorization", f"Bearer {self.token}"))
        if body:
            headers.append(("Content-Type", "application/json"))
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            self.outcomes[f"transport: {type(e).__name__}"] += 1
            return None
        try:
            writer.write(conn.send(h11.Request(method=method, target=path, headers=headers)))
            writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            await writer.drain()
            status, data, buffer = 0, bytearray(), bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await asyncio.wait_for(reader.read(65536), 120))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if on_event is not None and status == 200:
                        buffer += event.data
                        if not all([on_event(e) for e in _sse_events(buffer)]):
                            return None
                    else:
                        data += event.data
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, bytes(data)
        except (OSError, TimeoutError, h11.ProtocolError) as e:
            self.outcomes[f"transport: {type(e).__name__}"] += 1
            return None
        finally:
            writer.close()

    def count_http(self, status: int, body: bytes) -> None:
        self.outcomes[f"HTTP {status}"] += 1
        if status >= 300 and body:
            self.examples.setdefault(status, body[:300].decode(errors="replace"))

    async def normal_http(self, rng: random.Random) -> None:
        """A completion or a chat, unary or streamed, sometimes several prompts; a tenth cancelled mid-stream."""
        chat, stream = rng.random() < 0.5, rng.random() < 0.6
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        body: dict = {"max_tokens": rng.randint(4, 48), "temperature": rng.random(), "seed": rng.randrange(2**31)}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = [text, text[::-1]] if rng.random() < 0.2 else text
            if rng.random() < 0.3:
                body["n"] = 2
        body["stream"] = stream
        path = "/v1/chat/completions" if chat else "/v1/completions"
        cancel_after = rng.randint(1, 6) if stream and rng.random() < 0.1 else None
        start, seen, sent = time.perf_counter(), 0, time.monotonic()

        def on_event(data: bytes) -> bool:
            nonlocal seen
            if data.startswith(b'{"error"'):
                self.outcomes["HTTP 200, then an error event"] += 1
            if seen == 0:
                self.ttft.append(time.perf_counter() - start)
            seen += 1
            return cancel_after is None or seen < cancel_after

        reply = await self.http("POST", path, json.dumps(body).encode(), on_event if stream else None)
        if reply is None:
            if cancel_after is not None and seen >= cancel_after:
                self.outcomes["cancelled mid-stream (HTTP)"] += 1
            return
        self.count_http(*reply)
        if reply[0] == 200:
            self.latencies.append(time.perf_counter() - start)
            self.victims.append((sent, self.latencies[-1]))

    async def normal_grpc(self, rng: random.Random) -> None:
        """A gRPC stream (a tenth cancelled after a few chunks) or a unary call."""
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        req = build_request(text, max_tokens=rng.randint(4, 48), temperature=rng.random(), seed=rng.randrange(2**31))
        start, sent = time.perf_counter(), time.monotonic()
        try:
            if rng.random() < 0.3:
                await self.stub.GenerateUnary(req, timeout=120)
            else:
                cancel_after, chunks = (rng.randint(1, 6) if rng.random() < 0.1 else None), 0
                call = self.stub.Generate(req, timeout=120, metadata=self.metadata)
                async for resp in call:
                    if resp.HasField("chunk"):
                        if chunks == 0:
                            self.ttft.append(time.perf_counter() - start)
                        chunks += 1
                        if cancel_after is not None and chunks >= cancel_after:
                            call.cancel()
                            self.outcomes["cancelled mid-stream (gRPC)"] += 1
                            return
            self.outcomes["gRPC OK"] += 1
            self.latencies.append(time.perf_counter() - start)
            self.victims.append((sent, self.latencies[-1]))
        except grpc.RpcError as e:
            self.outcomes[f"gRPC {e.code().name}"] += 1

    async def hostile(self, rng: random.Random) -> None:
        """A bad HTTP body or method, or a bad gRPC chat field."""
        if rng.random() < 0.75:
            name = rng.choice(list(HOSTILE_HTTP))
            if (reply := await self.http(*HOSTILE_HTTP[name])) is not None:
                self.count_http(*reply)
                self.hostile_answers[f"{name} -> HTTP {reply[0]}"] += 1
            return
        name = rng.choice(list(HOSTILE_GRPC))
        tools, kwargs = HOSTILE_GRPC[name]
        chat = pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content="hi")], tools_json=tools, chat_template_kwargs_json=kwargs
        )
        try:
            await self.stub.GenerateUnary(build_request(chat, max_tokens=2), timeout=60)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        self.outcomes[f"gRPC {code}"] += 1
        self.hostile_answers[f"{name} -> gRPC {code}"] += 1

    async def new_http(self, rng: random.Random) -> None:
        """--soak-mix full: a valid request of a newer surface (a small constraint, declared tools under
        `tool_choice: auto`, prompt logprobs and logprobs), or a hostile body of one (`HOSTILE_HTTP_NEW`)."""
        if rng.random() < 0.3:
            name = rng.choice(list(HOSTILE_HTTP_NEW))
            if (reply := await self.http(*HOSTILE_HTTP_NEW[name])) is not None:
                self.count_http(*reply)
                self.hostile_answers[f"{name} -> HTTP {reply[0]}"] += 1
            return
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20)))
        kind = rng.choice(("regex", "schema", "tools", "logprobs"))
        body: dict = {"max_tokens": rng.randint(4, 24), "temperature": rng.random(), "seed": rng.randrange(2**31)}
        path = "/v1/completions"
        if kind == "regex":
            body |= {"prompt": text, "structured_outputs": {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,3}"}}
        elif kind == "schema":
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            body |= {"prompt": text, "structured_outputs": {"json": schema}}
        elif kind == "tools":
            path = "/v1/chat/completions"
            body |= {"messages": [{"role": "user", "content": text}], "tools": TOOLS, "tool_choice": "auto"}
        else:
            body |= {"prompt": text, "prompt_logprobs": 1, "logprobs": 2}
        start = time.perf_counter()
        reply = await self.http("POST", path, json.dumps(body).encode())
        if reply is not None:
            self.count_http(*reply)
            self.outcomes[f"new mix: {kind} -> HTTP {reply[0]}"] += 1
            if reply[0] == 200:
                self.latencies.append(time.perf_counter() - start)

    async def lora(self, rng: random.Random) -> None:
        """--soak-mix full: load an adapter under a fresh name, ask it for a completion, unload it; sometimes two
        concurrent loads of one name (one 200, the other 409)."""
        i = rng.randrange(1 << 30)
        name, path = f"soak-{i}", str(rng.choice(self.adapters))
        load = json.dumps({"lora_name": name, "lora_path": path}).encode()
        if rng.random() < 0.2:
            replies = await asyncio.gather(*(self.http("POST", "/v1/load_lora_adapter", load) for _ in range(2)))
            statuses = sorted(r[0] for r in replies if r is not None)
            for status in statuses:
                self.count_http(status, b"")
            self.outcomes[f"lora: concurrent loads of one name -> {statuses}"] += 1
        elif (reply := await self.http("POST", "/v1/load_lora_adapter", load)) is not None:
            self.count_http(*reply)
            self.outcomes[f"lora: load -> HTTP {reply[0]}"] += 1
        body = {"model": name, "prompt": rng.choice(WORDS), "max_tokens": rng.randint(2, 16), "temperature": 0}
        if (reply := await self.http("POST", "/v1/completions", json.dumps(body).encode())) is not None:
            self.count_http(*reply)
            self.outcomes[f"lora: completion -> HTTP {reply[0]}"] += 1
        unload = json.dumps({"lora_name": name}).encode()
        if (reply := await self.http("POST", "/v1/unload_lora_adapter", unload)) is not None:
            self.count_http(*reply)
            self.outcomes[f"lora: unload -> HTTP {reply[0]}"] += 1

    async def disconnect(self, rng: random.Random) -> None:
        """A client that sends a long request and hangs up before (unary) or after (stream) the first bytes."""
        stream = rng.random() < 0.5
        body = {"prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": stream}
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            self.outcomes[f"transport: {type(e).__name__}"] += 1
            return
        payload = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        head += f"Authorization: Bearer {self.token}\r\n" if self.token is not None else ""
        writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        try:
            await writer.drain()
            if stream:
                await asyncio.wait_for(reader.read(1), 60)
            else:
                await asyncio.sleep(rng.uniform(0.05, 1.0))
            self.outcomes[f"client hung up ({'stream' if stream else 'unary'})"] += 1
        except (OSError, TimeoutError) as e:
            self.outcomes[f"transport: {type(e).__name__}"] += 1
        finally:
            writer.close()

    async def never_reading(self, rng: random.Random) -> None:
        """An SSE client with a small receive window that reads nothing for 40 s (past the server's stall
        timeout, 30 s by default), then drains what is left: the server must have ended the stream."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        payload = json.dumps(UNREAD).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        head += f"Authorization: Bearer {self.token}\r\n" if self.token is not None else ""
        try:
            await loop.sock_connect(sock, (self.host, self.port))
            await loop.sock_sendall(sock, f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            await asyncio.sleep(max(0.0, min(40.0, self.until - time.monotonic() - 1)))
            tail = b""
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10):
                tail = (tail + chunk)[-256:]
            ended = b"0\r\n\r\n" in tail  # the chunked body's last chunk: the server finished the response
            self.outcomes[f"never-read stream {'ended by the server' if ended else 'cut'}"] += 1
        except ConnectionResetError:
            self.outcomes["never-read stream reset by the server"] += 1
        except (OSError, TimeoutError) as e:
            self.outcomes[f"never-read stream: {type(e).__name__}"] += 1
        finally:
            sock.close()

    async def loop(self, kind: Callable[[random.Random], Awaitable[None]], seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.until:
            await kind(rng)


def _metric(base_url: str, name: str, token: str | None = None) -> float:
    """One sample of the server's /metrics (0 before the counter has been touched)."""
    root = base_url.rsplit("/v1", 1)[0]
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with urllib.request.urlopen(urllib.request.Request(f"{root}/metrics", headers=headers), timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def soak(args: argparse.Namespace, target: str, proc: subprocess.Popen, log: ServerLog) -> SoakResult:
    host, port = urllib.parse.urlsplit(args.base_url).hostname, urllib.parse.urlsplit(args.base_url).port
    full, token = args.soak_mix == "full", getattr(args, "token", None)
    interceptors = [] if token is None else [BearerToken(token)]
    async with aio.insecure_channel(target, interceptors=interceptors) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        while (
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
        ).status != health_pb2.HealthCheckResponse.SERVING:
            await asyncio.sleep(0.1)
        marks: dict[str, float] = {}  # the full mix: compiles and RSS from the background warm-up's end

        async def after_warm_up() -> None:
            for _ in range(12000):  # polled, so that ^C is not stuck in a thread
                if log.warm.is_set() or proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            # one request, so the server's metrics mirror the engine's compile counters (they update after a step)
            await stub.GenerateUnary(build_request("warm", max_tokens=2), timeout=300)
            marks["compiles"] = await asyncio.to_thread(_metric, args.base_url, "paged_jax_compiles_total", token)
            marks["warm_s"] = time.monotonic()

        if full:
            print("serving; the traffic starts now, during the background warm-up", flush=True)
            warm_task = asyncio.create_task(after_warm_up())
        else:
            print("serving; waiting for the background warm-up to finish", flush=True)
            await after_warm_up()
        start = time.monotonic()
        s = Soak(stub, host, port, start + args.soak, token)
        s.adapters = getattr(args, "adapters", [])
        kinds = [(s.normal_http, args.soak_concurrency), (s.normal_grpc, max(1, args.soak_concurrency // 2))]
        if not args.soak_clean:
            kinds += [(s.hostile, 2), (s.disconnect, 1), (s.never_reading, 2)]
        if full and not args.soak_clean:
            kinds += [(s.new_http, 2), (s.lora, 1)]
        tasks = [asyncio.create_task(s.loop(kind, 1000 * i + j)) for i, (kind, n) in enumerate(kinds) for j in range(n)]
        peak = [0, 0]

        async def sample_open() -> None:
            while time.monotonic() < s.until:
                st = await stub.GetStats(pb.GetStatsRequest(), timeout=30)
                peak[:] = max(peak[0], st.num_open_requests), max(peak[1], st.num_waiting)
                await asyncio.sleep(1.0)

        tasks.append(asyncio.create_task(sample_open()))
        if full:
            await warm_task
            print(f"background warm-up done {marks['warm_s'] - start:.0f} s into the soak", flush=True)
        await asyncio.sleep(min(10.0, args.soak / 2))
        rss_start = rss_mib(proc.pid)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
        for _ in range(1200):  # the last streams finish or time out; every page back
            stats = await stub.GetStats(pb.GetStatsRequest(check_invariants=True), timeout=30)
            if stats.num_open_requests == 0 and stats.pages_in_use == 0:
                break
            await asyncio.sleep(0.1)
        rss_end = rss_mib(proc.pid)
        after_warmup = await asyncio.to_thread(_metric, args.base_url, "paged_jax_compiles_after_warmup_total", token)
        compiles_end = await asyncio.to_thread(_metric, args.base_url, "paged_jax_compiles_total", token)
        compiles_start = marks["compiles"]
    internal = sum(s.outcomes[f"gRPC {c}"] for c in ("INTERNAL", "UNKNOWN", "DATA_LOSS"))
    return SoakResult(
        seconds=elapsed,
        outcomes=s.outcomes,
        max_open_requests=peak[0],
        max_waiting=peak[1],
        hostile_answers=s.hostile_answers,
        examples=s.examples,
        latencies_s=s.latencies,
        victim_s=[seconds for sent, seconds in s.victims if sent >= marks["warm_s"]],
        ttft_s=s.ttft,
        client_errors_500=sum(v for k, v in s.outcomes.items() if re.fullmatch(r"HTTP 5\d\d", k)),
        grpc_internal=internal,
        rss_start_mib=rss_start,
        rss_end_mib=rss_end,
        pages_in_use=stats.pages_in_use,
        pages_total=stats.pages_total,
        open_requests=stats.num_open_requests,
        invariants="ok" if stats.invariants_ok else stats.invariants_error,
        compiles_after_warmup=after_warmup,
        compiles_during_soak=compiles_end - compiles_start,
        during_warm_up=full,
        error_log_lines=log.errors,
        load_average=" ".join(Path("/proc/loadavg").read_text().split()[:3]),
    )


class ServerLog:
    """Reads the server's output on a thread: notes when the background warm-up has finished, counts ERROR
    lines and tracebacks (kept in `tail` to show) and, with `path`, writes every line there."""

    def __init__(self, stream, path: Path | None = None) -> None:
        self.warm = threading.Event()
        self.errors = 0
        self.tail: list[str] = []
        self.path = path
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        out = self.path.open("w") if self.path is not None else None
        for line in stream:
            if out is not None:
                out.write(line)
                out.flush()
            # the background warm-up's summary line ("background warm-up: N executables ..."), not its progress
            if re.search(r"background warm-up: \d+ executables", line) or "background warm-up failed" in line:
                self.warm.set()
            if " ERROR " in line or line.startswith("Traceback"):
                self.errors += 1
                self.tail = (self.tail + [line.rstrip()[:300]])[-10:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="an already running server (default: start one)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--max-queued", type=int, default=512)
    p.add_argument("--http", action="store_true", help="drive the OpenAI HTTP front (--port) instead of gRPC")
    p.add_argument("--base-url", default=None, help="with --http and --target: the server's OpenAI base URL")
    p.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="SECONDS",
        help="soak mode: start a server with both fronts and drive the mixed load for SECONDS (see the docstring)",
    )
    p.add_argument("--soak-ngram", action="store_true", help="with --soak-mix full: n-gram speculation on")
    p.add_argument("--front-nice", type=int, default=0, help="with --soak: the server's --front-nice")
    p.add_argument("--soak-clean", action="store_true", help="with --soak: the normal clients (the victims) alone")
    p.add_argument(
        "--soak-compare", action="store_true", help="with --soak: a clean soak, then this one; the victim p99 ratio"
    )
    p.add_argument("--victim", action="store_true", help="the victim-latency table beside each hostile constraint")
    p.add_argument("--victim-flood", type=int, default=0, help="with --victim: clients resending each attack")
    p.add_argument(
        "--soak-mix",
        choices=("basic", "full"),
        default="basic",
        help="with --soak: full adds auth, LoRA loads, n-gram speculation, structured output, tools, logprobs",
    )
    p.add_argument(
        "--soak-concurrency",
        type=int,
        default=6,
        help="with --soak: normal HTTP clients (half as many gRPC ones; 2 hostile, 1 disconnecting, 2 never reading)",
    )
    args = p.parse_args(argv)
    if args.soak is not None and (args.soak <= 0 or args.target):
        p.error("--soak takes a positive number of seconds and starts its own server (no --target)")
    return args


def main_soak(args: argparse.Namespace) -> int:
    """Run the soak, print its table and the goals; 1 when a goal failed. With `--soak-compare` a clean soak runs
    first, and the ratio of the victim p99s is a goal too."""
    if not args.soak_compare:
        return run_soak(args)[0]
    clean_args = argparse.Namespace(**{**vars(args), "soak_clean": True})
    print("-- the clean soak: the victims' clients alone --", flush=True)
    clean = run_soak(clean_args)[1]
    print("-- the soak --", flush=True)
    status, result = run_soak(args)
    ratio = pct(result.victim_s, 0.99) / pct(clean.victim_s, 0.99)
    ok = ratio <= 2.0
    print(
        f"victim p99: {pct(result.victim_s, 0.99) * 1e3:.0f} ms beside the mix, {pct(clean.victim_s, 0.99) * 1e3:.0f} "
        f"ms in the clean soak: {ratio:.2f}x (goal <= 2x: {'pass' if ok else 'FAIL'})"
    )
    return status or (0 if ok else 1)


def run_soak(args: argparse.Namespace) -> tuple[int, SoakResult]:
    """One soak in its own server: its table and goals printed; (1 when a goal failed, else 0; the result)."""
    proc, target, log = start_server(args)
    try:
        result = asyncio.run(soak(args, target, proc, log))
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(timeout=60)
        print(f"server log: {log.path}")
    table, ok = soak_report(result)
    mix = "the victims alone (clean)" if args.soak_clean else f"mix {args.soak_mix}"
    mix += ", n-gram speculation" if args.soak_ngram else ""
    print(f"soak of {args.soak:.0f} s on {args.model}, both fronts, {mix}; server exit code after SIGTERM: {exit_code}")
    print(table)
    answers = ", ".join(f"{k} x{v}" for k, v in sorted(result.hostile_answers.items()))
    print(f"hostile requests, case -> answer: {answers}")
    for status, body in sorted(result.examples.items()):
        print(f"first HTTP {status} body: {body}")
    if log.tail:
        print("last server ERROR lines:", *log.tail, sep="\n  ")
    return (0 if ok else 1), result


# Each attack's body: the hostile constraints of issue 41 items 1, 2 and 5, and an in-bound constraint
_BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 8} for i in range(60_000)}}
VICTIM_ATTACKS: dict[str, tuple[str, bytes]] = {
    **{k: (path, body) for k, (_, path, body) in HOSTILE_HTTP_NEW.items() if not path.endswith("lora_adapter")},
    "schema-2MB": (
        "/v1/completions",
        json.dumps({"prompt": "a", "max_tokens": 4, "structured_outputs": {"json": _BIG_SCHEMA}}).encode(),
    ),
    "regex-in-bound-a{9999}": (
        "/v1/completions",
        json.dumps({"prompt": "a", "max_tokens": 8, "n": 4, "structured_outputs": {"regex": "a{9999}"}}).encode(),
    ),
}
VICTIM = {"prompt": "hello", "max_tokens": 64, "temperature": 0, "ignore_eos": True}


def _post_http(base_url: str, path: str, body: bytes, token: str | None) -> int:
    headers = {"Content-Type": "application/json"} | ({} if token is None else {"Authorization": f"Bearer {token}"})
    root = base_url.rsplit("/v1", 1)[0]
    try:
        with urllib.request.urlopen(urllib.request.Request(root + path, body, headers), timeout=600) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def victim_seconds(args: argparse.Namespace, attack: tuple[str, bytes] | None) -> tuple[float, Counter[int]]:
    """The victim's seconds, alone or beside `attack` (sent once, or by `--victim-flood` clients resending it
    until the victim is done); the attack's statuses."""
    done, statuses = threading.Event(), Counter()

    def attacker() -> None:
        while True:
            statuses[_post_http(args.base_url, attack[0], attack[1], args.token)] += 1
            if not args.victim_flood or done.is_set():
                return

    clients = max(1, args.victim_flood) if attack else 0
    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    status = _post_http(args.base_url, "/v1/completions", json.dumps(VICTIM).encode(), args.token)
    seconds = time.perf_counter() - t0
    done.set()
    for t in threads:
        t.join(600)
    assert status == 200, f"the victim got HTTP {status}"
    return seconds, statuses


def main_victim(args: argparse.Namespace) -> int:
    """`--victim`: the isolation table (see the module docstring)."""
    args.soak, args.soak_mix = 1.0, "full"
    proc, _, log = start_server(args)
    try:
        for _ in range(12000):
            if log.warm.is_set() or proc.poll() is not None:
                break
            time.sleep(0.1)
        victim_seconds(args, None)  # its shapes compiled and cached
        print(f"model {args.model}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        alone = sorted(victim_seconds(args, None)[0] for _ in range(3))[1]
        print("| beside | victim s (median of 3) | x alone | attack answers |\n|---|---:|---:|---|")
        print(f"| alone | {alone:.2f} | 1.00 | |")
        worst = 1.0
        for name, attack in VICTIM_ATTACKS.items():
            runs = [victim_seconds(args, attack) for _ in range(3)]
            seconds = sorted(r[0] for r in runs)[1]
            answers = sum((r[1] for r in runs), Counter())
            worst = max(worst, seconds / alone)
            codes = ", ".join(f"{k} x{v}" for k, v in sorted(answers.items()))
            print(f"| {name} | {seconds:.2f} | {seconds / alone:.2f} | {codes} |", flush=True)
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; worst {worst:.2f}x (goal <= 1.5x)")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return 0 if worst <= 1.5 else 1


def main() -> int:
    args = parse_args()
    if args.victim:
        return main_victim(args)
    if args.soak is not None:
        return main_soak(args)
    proc, target, _ = (None, args.target, None) if args.target else start_server(args)
    pid = proc.pid if proc else None
    try:
        r = asyncio.run(run(args, target, pid))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_code = proc.wait(timeout=60)
    load, stats, rss = r["load"], r["stats"], r["rss"]
    unexpected = {k: v for k, v in load.codes.items() if k not in EXPECTED}
    print(
        f"{'HTTP (OpenAI)' if args.http else 'gRPC'}, concurrency {args.concurrency}, {r['elapsed']:.1f} s, "
        f"{load.done} requests"
    )
    print(f"requests/s {load.done / r['elapsed']:.1f}, generated tokens/s {load.tokens / r['elapsed']:.0f}")
    print(f"TTFT p50 {pct(load.ttft, 0.5) * 1e3:.1f} ms, p99 {pct(load.ttft, 0.99) * 1e3:.1f} ms")
    print(f"status codes {dict(load.codes)}; unexpected {unexpected or 'none'}")
    invariants = "ok" if stats.invariants_ok else stats.invariants_error
    print(
        f"pages at the end: {stats.pages_free}/{stats.pages_total} free, in use {stats.pages_in_use}, "
        f"open requests {stats.num_open_requests}, invariants {invariants}"
    )
    if r["cpu"] is not None:
        print(
            f"server CPU {r['cpu']:.1f} s over the run ({r['cpu'] / max(1, load.tokens) * 1e3:.2f} ms per "
            "generated token)"
        )
    if rss:
        warm = rss[len(rss) // 4 :] or rss
        print(
            f"server RSS MiB: start {rss[0]:.0f}, after warm-up {warm[0]:.0f}, max {max(rss):.0f}, "
            f"end {rss[-1]:.0f} (growth after warm-up {warm[-1] - warm[0]:+.0f})"
        )
    if proc is not None:
        print(f"server exit code after SIGTERM: {exit_code}")
    ok = not unexpected and stats.pages_in_use == 0 and stats.invariants_ok and stats.num_open_requests == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

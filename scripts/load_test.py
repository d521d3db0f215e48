"""Load test: bounded concurrent streams for a bounded time against a loopback `paged-jax serve` server.

    .venv/bin/python scripts/load_test.py --concurrency 256 --duration 60
    .venv/bin/python scripts/load_test.py --http ...   # the same mix through the OpenAI HTTP front

With `--http` the streams go to `/v1/completions` (stream: true) through the official `openai` client,
a cancelled one by closing its connection mid-stream; the end-of-run page check still uses gRPC GetStats.

Starts the server as a subprocess (unless --target is given), keeps `--concurrency` streams open for
`--duration` seconds (each finished stream is replaced by a new one), cancels a tenth of them at a
random point, then reports requests/s, tokens/s, TTFT p50/p99, errors by status code, whether every
KV page is free at the end (stats RPC + invariant check), and the server's RSS over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serve.client import build_request  # noqa: E402
from serve.proto.paged_jax.v1 import generate_pb2 as pb  # noqa: E402
from serve.proto.paged_jax.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402

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


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "serve",
        "serve",
        "--model",
        args.model,
        "--port",
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
    if args.http:
        cmd += ["--http-port", "0"]
    if args.num_pages:
        cmd += ["--num-pages", str(args.num_pages)]
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
        if target is not None and (args.base_url or not args.http):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, target
    raise SystemExit(f"server exited with {proc.wait()}")


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


def main() -> int:
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
    p.add_argument("--http", action="store_true", help="drive the OpenAI HTTP front (--http-port) instead of gRPC")
    p.add_argument("--base-url", default=None, help="with --http and --target: the server's OpenAI base URL")
    args = p.parse_args()
    proc, target = (None, args.target) if args.target else start_server(args)
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

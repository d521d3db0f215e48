"""A fleet of `paged-jax serve` replicas behind vLLM's router: prefix-aware (its `kv_aware` policy, routing on the
replicas' KV events) against `round_robin`, on a multi-tenant workload; or behind SGLang's router
(``--router-kind sglang``: its `cache_aware` policy, a tree of the prompts it routed, no events).

Each policy gets a fresh fleet: N servers publishing KV events (`--kv-events-config`) and one `vllm-router`
(`pip install vllm-router`; give its binary with --router) subscribed to them. The workload: `--tenants` system
prompts of `--system-chars` characters, each followed by `--users` users' short questions, sent one at a time
(or `--concurrency` at a time) through the router in a shuffled order (so round-robin spreads a tenant over the
replicas) as streaming completions. Reported per policy: the prefix-cache hit rate (cached prompt tokens /
prompt tokens, from each reply's usage), time to first token p50/p99, requests/s, the requests each replica
served, and whether every reply's text equals round-robin's (greedy); then the machine's load average.

    .venv/bin/python scripts/bench/bench_fleet.py --router /path/to/vllm-router [--replicas 4] [--model tiny]

``--trace FILE`` profiles the routing: the script subscribes to every replica's events itself and keeps each
replica's block set from them (`EventIndex`); per request it writes one JSON line with the leading blocks each
replica held by those events just before the request, the replica the router chose (the one whose request
counter moved), the blocks that replica's reply reported cached, and the events each replica published since.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from paged_jax.kv_cache.hashing import BlockHasher

ROOT = Path(__file__).resolve().parents[2]
READY = {"vllm": r"Starting server on", "sglang": r"Starting server on"}  # the router's log line once it listens


def start_server(model: str, i: int, base: int, extra: list[str]) -> tuple[subprocess.Popen, int, int]:
    http_port, zmq_port = base + i, base + 100 + i
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{zmq_port}",
        "replay_endpoint": f"tcp://*:{zmq_port + 50}",
    }
    cmd = [sys.executable, "-m", "serve", "serve", model, "--port", str(http_port), "--grpc-port", str(base + 200 + i)]
    cmd += ["--no-warmup", "--kv-events-config", json.dumps(events), *extra]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, http_port, zmq_port


def wait_for(proc: subprocess.Popen, pattern: str, what: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(pattern, line):
            return
    raise SystemExit(f"{what} exited before it was ready")


def drain(proc: subprocess.Popen, path: str | None) -> None:
    """Keep reading ``proc``'s output (into ``path``, or dropped) so a full pipe never stalls it."""
    import threading

    def run() -> None:
        assert proc.stdout is not None
        with open(path or os.devnull, "a") as out:
            for line in proc.stdout:
                out.write(line)

    threading.Thread(target=run, daemon=True).start()


def stream(port: int, model: str, prompt: str, max_tokens: int) -> tuple[float, str, int, int]:
    """(seconds to the first token, text, prompt tokens, cached prompt tokens) of one streaming completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, text, usage = None, [], {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or ():
            if choice.get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(choice.get("text", ""))
        usage = chunk.get("usage") or usage
    conn.close()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(text), usage["prompt_tokens"], cached


class EventIndex:
    """One replica's cached blocks as its KV event stream tells them (device and host tier), kept by a thread that
    reads the replica's ZMQ PUB socket: what an exact event consumer knows at each moment."""

    def __init__(self, zmq_port: int) -> None:
        import threading

        import msgpack  # type: ignore[import-untyped]
        import zmq

        self.blocks: dict[str, set[bytes]] = {"GPU": set(), "CPU": set()}
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "batches": 0, "gaps": 0}
        self.lock = threading.Lock()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(f"tcp://127.0.0.1:{zmq_port}")
        self._unpack, self._stop, self._last = msgpack.unpackb, False, -1
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                _, seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            n = int.from_bytes(seq, "big", signed=True)
            _, events, *_ = self._unpack(payload)
            with self.lock:
                self.counts["gaps"] += self._last >= 0 and n != self._last + 1
                self._last, self.counts["batches"] = n, self.counts["batches"] + 1
                for e in events:
                    kind, medium = e["type"], e.get("medium") or "GPU"
                    if kind == "BlockStored":
                        self.blocks[medium].update(e["block_hashes"])
                        self.counts["stored"] += len(e["block_hashes"])
                    elif kind == "BlockRemoved":
                        self.blocks[medium].difference_update(e["block_hashes"])
                        self.counts["removed"] += len(e["block_hashes"])
                    else:
                        self.counts["cleared"] += 1
                        for held in self.blocks.values():
                            held.clear()

    def depth(self, hashes: list[bytes], medium: str = "GPU") -> int:
        """Leading blocks of ``hashes`` this replica holds (by its events)."""
        with self.lock:
            held = self.blocks[medium]
            return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self._sock.close(0)


def tokenize(port: int, prompt: str) -> list[int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/tokenize", json.dumps({"prompt": prompt}), {"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())["tokens"]
    conn.close()
    return out


def served_requests(port: int) -> float:
    """The replica's finished-request count (its Prometheus counter, every method)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("paged_jax_requests_total"))


def router_metrics(port: int) -> list[str]:
    """The router's Prometheus lines on KV placement and per-worker requests (what it decided)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except OSError:
        return []
    finally:
        conn.close()
    keep = ("kv_placement", "processed_requests", "requests_total")
    return [line for line in text.splitlines() if not line.startswith("#") and any(k in line for k in keep)]


def concurrent_streams(args, prompts: list[str]) -> tuple[list[float], list[str], int, int]:
    """`--concurrency` clients sending the prompts in order through the router, each its next one as soon as
    its last reply is done: (TTFTs, texts in prompt order, prompt tokens, cached prompt tokens)."""
    with ThreadPoolExecutor(args.concurrency) as pool:
        replies = list(pool.map(lambda p: stream(args.router_port, args.model, p, args.max_tokens), prompts))
    return [r[0] for r in replies], [r[1] for r in replies], sum(r[2] for r in replies), sum(r[3] for r in replies)


def run_policy(args, policy: str, prompts: list[str]) -> dict:
    servers = [start_server(args.model, i, args.base_port, args.server_args) for i in range(args.replicas)]
    router = None
    try:
        for proc, port, _ in servers:
            wait_for(proc, r"OpenAI API on", f"server on {port}")
        urls = [f"http://127.0.0.1:{port}" for _, port, _ in servers]
        launcher = [args.router] if args.router_kind == "vllm" else [args.router, "-m", "sglang_router.launch_router"]
        cmd = [*launcher, "--host", "127.0.0.1", "--port", str(args.router_port), "--policy", policy]
        cmd += ["--worker-urls", *urls, "--prometheus-port", str(args.router_port + 1), *shlex.split(args.router_args)]
        if policy == "kv_aware":
            cmd += ["--kv-event-model", args.model, "--kv-event-block-size", str(args.page_size)]
            for url, (_, _, zmq_port) in zip(urls, servers, strict=True):
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{zmq_port}"]
                cmd += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{zmq_port + 50}"]
        env = dict(os.environ, RUST_LOG="debug") if args.router_log else None
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        wait_for(router, READY[args.router_kind], f"{args.router_kind} router")
        drain(router, args.router_log)
        for proc, _, _ in servers:
            drain(proc, None)
        time.sleep(1.0)
        stream(args.router_port, args.model, "warm up", 2)  # each replica's first step shapes compile here
        for _, port, _ in servers:
            stream(port, args.model, "warm up " + "x" * 40, 2)
        ttfts, texts, prompt_tokens, cached = [], [], 0, 0
        trace, indexes = None, []
        if args.trace:
            trace = open(f"{args.trace}.{policy}.jsonl", "w")  # noqa: SIM115 (closed below)
            indexes = [EventIndex(zmq_port) for _, _, zmq_port in servers]
            hasher = BlockHasher(args.page_size)
            token_ids = [tokenize(servers[0][1], p) for p in prompts]
            time.sleep(1.0)
        served_before = [served_requests(port) for _, port, _ in servers]
        t0 = time.perf_counter()
        if args.concurrency > 1:
            ttfts, texts, prompt_tokens, cached = concurrent_streams(args, prompts)
        for k, prompt in enumerate(prompts if args.concurrency == 1 else []):
            if trace is not None:
                hashes = hasher.extend([], token_ids[k], len(token_ids[k]) // args.page_size)
                before = [served_requests(port) for _, port, _ in servers]
                held = [ix.depth(hashes) for ix in indexes]
                host = [ix.depth(hashes, "CPU") for ix in indexes]
                counts = [dict(ix.counts) for ix in indexes]
            ttft, text, n, c = stream(args.router_port, args.model, prompt, args.max_tokens)
            if trace is not None:
                after = [served_requests(port) for _, port, _ in servers]
                chosen = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
                pairs = zip(indexes, counts, strict=True)
                since = [{key: ix.counts[key] - was[key] for key in was} for ix, was in pairs]
                row = {"k": k, "blocks": len(hashes), "held": held, "host": host, "chosen": chosen,
                       "cached_blocks": c // args.page_size, "events_since": since}  # fmt: skip
                trace.write(json.dumps(row) + "\n")
                time.sleep(args.trace_gap)
            ttfts.append(ttft)
            texts.append(text)
            prompt_tokens += n
            cached += c
        seconds = time.perf_counter() - t0
        per_replica = [served_requests(port) - b for (_, port, _), b in zip(servers, served_before, strict=True)]
        routed = router_metrics(args.router_port + 1)
        if trace is not None:
            trace.close()
            for ix in indexes:
                ix.close()
    finally:
        for proc in [router] + [s[0] for s in servers]:
            if proc is not None:
                proc.terminate()
        for proc in [router] + [s[0] for s in servers]:
            if proc is not None:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    p50, p99 = np.percentile(ttfts, [50, 99]) * 1e3
    return {"routed": routed, "hit_rate": cached / prompt_tokens, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "req_s": len(prompts) / seconds, "texts": texts, "per_replica": per_replica}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--router",
        default=shutil.which("vllm-router"),
        help="the vllm-router binary (with --router-kind sglang: a Python that has sglang-router)",
    )
    ap.add_argument(
        "--router-kind",
        choices=("vllm", "sglang"),
        default="vllm",
        help="vllm: vLLM's router (round_robin, kv_aware, cache_aware); sglang: SGLang's (`pip install sglang-router`; "
        "round_robin, cache_aware)",
    )
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--system-chars", type=int, default=1024, help="characters of each system prompt (the shortest)")
    ap.add_argument(
        "--system-chars-max", type=int, default=None, help="the longest system prompt (lengths uniform in between)"
    )
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--base-port", type=int, default=19000)
    ap.add_argument("--router-port", type=int, default=19400)
    ap.add_argument("--policies", default="round_robin,kv_aware")
    ap.add_argument("--concurrency", type=int, default=1, help="clients sending at once (1: one at a time)")
    ap.add_argument("--trace", default=None, help="write the routing profile to FILE.<policy>.jsonl (docstring)")
    ap.add_argument("--trace-gap", type=float, default=0.0, help="seconds to wait after each traced request")
    ap.add_argument("--router-args", default="", help="more vllm-router flags in one string (--router-temperature 1)")
    ap.add_argument("--router-log", default=None, help="append the router's output (RUST_LOG=debug) to this file")
    ap.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=["--num-pages", "512", "--max-model-len", "2048"]
    )
    args = ap.parse_args()
    if args.concurrency < 1 or (args.concurrency > 1 and args.trace):
        raise SystemExit("--concurrency: at least 1, and 1 with --trace (the profile reads each request alone)")
    if not args.router:
        raise SystemExit("--router: vllm-router not found (pip install vllm-router)")
    rng = np.random.default_rng(0)
    words = ["system", "policy", "tenant", "answer", "briefly", "always", "the", "user", "asks", "about", "data"]
    longest = max(args.system_chars, args.system_chars_max or args.system_chars)
    sizes = rng.integers(args.system_chars, longest + 1, args.tenants)
    systems = [" ".join(rng.choice(words, int(n) // 4))[: int(n)] for n in sizes]
    prompts = [
        f"{systems[t]}\nUser {u}: question {u * 31 + t}?" for u in range(args.users) for t in range(args.tenants)
    ]
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]  # no tenant lands on one replica by arithmetic
    results = {p: run_policy(args, p, prompts) for p in args.policies.split(",")}
    pace = "one at a time" if args.concurrency == 1 else f"{args.concurrency} at a time"
    print(f"{args.replicas} replicas of {args.model}, {args.tenants} tenants x {args.users} users, "
          f"{args.system_chars}-{longest}-char system prompts ({int(sizes.sum())} chars in all), "
          f"{len(prompts)} requests {pace}, server args {' '.join(args.server_args)}, "
          f"router args {args.router_args or '(none)'}")  # fmt: skip
    print(f"{'policy':12s} {'hit rate':>9s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'req/s':>7s}  requests per replica")
    for p, r in results.items():
        print(f"{p:12s} {r['hit_rate']:9.1%} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:8.1f}ms {r['req_s']:7.2f}  "
              f"{' / '.join(str(int(n)) for n in r['per_replica'])}")  # fmt: skip
    print(f"load average (1, 5, 15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for p, r in results.items():
        for line in r["routed"]:
            print(f"  {p} router: {line}")
    for aware in ("kv_aware", "cache_aware"):
        if {"round_robin", aware} <= results.keys():
            rr, kv = results["round_robin"], results[aware]
            same = rr["texts"] == kv["texts"]
            hit_x = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
            ttft_x = rr["ttft_p50_ms"] / kv["ttft_p50_ms"]
            print(f"{aware} vs round_robin: {hit_x:.2f}x the hit rate (goal >= 3x), {ttft_x:.2f}x lower TTFT p50 "
                  f"(goal >= 2x), same outputs: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

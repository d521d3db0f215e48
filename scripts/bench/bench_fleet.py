"""A fleet of `paged-jax serve` replicas behind vLLM's router: prefix-aware (its `kv_aware` policy, routing on the
replicas' KV events) against `round_robin`, on a multi-tenant workload.

Each policy gets a fresh fleet: N servers publishing KV events (`--kv-events-config`) and one `vllm-router`
(`pip install vllm-router`; give its binary with --router) subscribed to them. The workload: `--tenants` system
prompts of `--system-chars` characters, each followed by `--users` users' short questions, sent one at a time
through the router in a shuffled order (so round-robin spreads a tenant over the replicas) as streaming
completions. Reported per policy: the prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
reply's usage), time to first token p50/p99, requests/s, and whether every reply's text equals the other
policy's (greedy).

    .venv/bin/python scripts/bench/bench_fleet.py --router /path/to/vllm-router [--replicas 4] [--model tiny]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


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


def run_policy(args, policy: str, prompts: list[str]) -> dict:
    servers = [start_server(args.model, i, args.base_port, args.server_args) for i in range(args.replicas)]
    router = None
    try:
        for proc, port, _ in servers:
            wait_for(proc, r"OpenAI API on", f"server on {port}")
        urls = [f"http://127.0.0.1:{port}" for _, port, _ in servers]
        cmd = [args.router, "--host", "127.0.0.1", "--port", str(args.router_port), "--policy", policy]
        cmd += ["--worker-urls", *urls, "--prometheus-port", str(args.router_port + 1)]
        if policy == "kv_aware":
            cmd += ["--kv-event-model", args.model, "--kv-event-block-size", str(args.page_size)]
            for url, (_, _, zmq_port) in zip(urls, servers, strict=True):
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{zmq_port}"]
                cmd += ["--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{zmq_port + 50}"]
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_for(router, r"Starting server on", "vllm-router")
        time.sleep(1.0)
        stream(args.router_port, args.model, "warm up", 2)  # each replica's first step shapes compile here
        for _, port, _ in servers:
            stream(port, args.model, "warm up " + "x" * 40, 2)
        ttfts, texts, prompt_tokens, cached = [], [], 0, 0
        t0 = time.perf_counter()
        for prompt in prompts:
            ttft, text, n, c = stream(args.router_port, args.model, prompt, args.max_tokens)
            ttfts.append(ttft)
            texts.append(text)
            prompt_tokens += n
            cached += c
        seconds = time.perf_counter() - t0
        routed = router_metrics(args.router_port + 1)
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
            "req_s": len(prompts) / seconds, "texts": texts}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--router", default=shutil.which("vllm-router"), help="the vllm-router binary")
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
    ap.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=["--num-pages", "512", "--max-model-len", "2048"]
    )
    args = ap.parse_args()
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
    print(f"{args.replicas} replicas of {args.model}, {args.tenants} tenants x {args.users} users, "
          f"{args.system_chars}-{longest}-char system prompts ({int(sizes.sum())} chars in all), "
          f"{len(prompts)} requests one at a time, server args {' '.join(args.server_args)}")  # fmt: skip
    print(f"{'policy':12s} {'hit rate':>9s} {'TTFT p50':>10s} {'TTFT p99':>10s} {'req/s':>7s}")
    for p, r in results.items():
        print(f"{p:12s} {r['hit_rate']:9.1%} {r['ttft_p50_ms']:8.1f}ms {r['ttft_p99_ms']:8.1f}ms {r['req_s']:7.2f}")
    for p, r in results.items():
        for line in r["routed"]:
            print(f"  {p} router: {line}")
    if {"round_robin", "kv_aware"} <= results.keys():
        rr, kv = results["round_robin"], results["kv_aware"]
        same = rr["texts"] == kv["texts"]
        hit_x = kv["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        ttft_x = rr["ttft_p50_ms"] / kv["ttft_p50_ms"]
        print(f"kv_aware vs round_robin: {hit_x:.2f}x the hit rate (goal >= 3x), {ttft_x:.2f}x lower TTFT p50 "
              f"(goal >= 2x), same outputs: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

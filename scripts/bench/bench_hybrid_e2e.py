"""Hybrid KV memory end to end: a scaled-down Gemma-3-shaped model on the engine, KV cache groups vs full-length pages.

The model is Gemma-3-4B's config (sliding windows 5 : 1 global, two RoPE bases, q/k norms) cut down to ``--layers``
layers of width ``--hidden`` (4 query heads, 2 KV heads of ``hidden / 4``), with a ``--window``-token window and random
weights (``paged_jax.model.init``: nothing here depends on what the tokens say), float32, on the platform JAX picks.
Both engines get the same KV budget in bytes (``cpu_kv_cache_bytes``), so the hybrid one has more, smaller pages (a
page is ``slots_per_page`` layer slabs instead of every layer's).

Part 1 (throughput at equal budget): ``--requests`` requests with prompts of ``--prompt`` +- 25 % tokens generate
``--output`` tokens greedily, all queued at once, ``--repeat`` times per layout (alternating). Reported: generated
tokens per second of wall time and per second of the process's CPU time (less sensitive to a shared machine's
load; the median run of each), the mean running sequences, the peak pages in use (and their
bytes), preemptions.

Part 2 (multi-turn): ``--conversations`` chats of ``--turns`` turns; each turn appends a ``--user``-token message
(longer than the window) to the chat so far and generates ``--output`` tokens; the conversations' turns run
together (the same engines as part 1, after it). Reported: the prefix-cache hit rate of the turns after the first
(hit tokens over prompt tokens) and their TTFT p50, ``--repeat`` times per layout (alternating; the median run).

Every step shape is compiled before the clock starts (``warmup``). The greedy outputs of both layouts must be
identical; the script exits non-zero otherwise.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench/bench_hybrid_e2e.py
    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench/bench_hybrid_e2e.py --window 256 --prompt 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer


@dataclass
class Throughput:
    pages: int
    page_bytes: int
    tokens_per_s: float
    tokens_per_cpu_s: float
    mean_running: float
    peak_pages: int
    preemptions: int
    outputs: list[list[int]]


@dataclass
class MultiTurn:
    hit_rate: float
    ttft_p50_ms: float
    prompt_tokens: int
    outputs: list[list[int]]


def model_config(args: argparse.Namespace) -> ModelConfig:
    base = load_model_config("gemma-3-4b")
    heads = 4
    return base.replace(
        name=f"gemma-3-shaped-{args.layers}l",
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_heads=heads,
        num_kv_heads=2,
        head_dim=args.hidden // heads,
        vocab_size=320,  # the byte tokenizer's
        sliding_window=args.window,
        max_position_embeddings=args.max_model_len,
        dtype="float32",
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def engine(config: ModelConfig, params, args: argparse.Namespace, hybrid: bool) -> LLMEngine:
    ec = EngineConfig(
        page_size=args.page_size,
        cpu_kv_cache_bytes=args.kv_mib * 2**20,
        hybrid_kv=hybrid,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.chunk,
        chunk_size=args.chunk,
        max_model_len=args.max_model_len,
        warmup=True,  # every step shape compiled before the clock starts
    )
    return LLMEngine(config, params, ByteTokenizer(), ec)


def page_bytes(e: LLMEngine, config: ModelConfig) -> int:
    """Bytes of one page: its layer slabs x page size x K and V x KV heads x head_dim x 4 (float32)."""
    return e.kv_layout.slots_per_page * e.kv.page_size * 2 * config.num_kv_heads * config.head_dim * 4


def throughput(e: LLMEngine, config: ModelConfig, args: argparse.Namespace) -> Throughput:
    assert e.kv.reset_prefix_cache()  # a repeated run must not hit the previous one's prompts
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(int(args.prompt * 0.75), int(args.prompt * 1.25) + 1, args.requests)
    prompts = [rng.integers(3, 259, n).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(f"q{i}", p, greedy)
    done: dict[str, list[int]] = {}
    running, peak = [], 0
    t0, c0 = time.perf_counter(), time.process_time()
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        running.append(e.num_running)
        peak = max(peak, e.kv.stats().pages_in_use)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    e.check_invariants()
    generated = sum(len(o) for o in done.values())
    return Throughput(
        e.num_pages - 1,
        page_bytes(e, config),
        generated / seconds,
        generated / cpu_seconds,
        statistics.fmean(running),
        peak,
        e.stats().num_preemptions,
        [done[f"q{i}"] for i in range(len(prompts))],
    )


def multi_turn(e: LLMEngine, args: argparse.Namespace) -> MultiTurn:
    assert e.kv.reset_prefix_cache()
    rng = np.random.default_rng(args.seed + 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    history = [rng.integers(3, 259, args.user).tolist() for _ in range(args.conversations)]
    ttft: list[float] = []
    outputs: list[list[int]] = []
    queries = hits = 0
    for turn in range(args.turns):
        if turn:
            for h in history:
                h += rng.integers(3, 259, args.user).tolist()
        before = e.kv.stats()
        for c, h in enumerate(history):
            e.add_request(f"c{c}.t{turn}", list(h), greedy)
        done = {}
        while e.has_unfinished():
            for out in e.step():
                if out.finished:
                    done[out.request_id] = out
        after = e.kv.stats()
        for c, h in enumerate(history):
            out = done[f"c{c}.t{turn}"]
            reply = list(out.outputs[0].token_ids)
            outputs.append(reply)
            h += reply
            if turn and out.metrics.time_to_first_token is not None:
                ttft.append(out.metrics.time_to_first_token)
        if turn:
            queries += after.prefix_queries - before.prefix_queries
            hits += after.prefix_hits - before.prefix_hits
    e.check_invariants()
    return MultiTurn(hits / max(1, queries), 1000 * statistics.median(ttft), queries, outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="two periods of Gemma 3's 5 : 1 pattern")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens and the prefill chunk")
    ap.add_argument("--kv-mib", type=int, default=16, help="the KV budget of both engines, MiB")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=1024, help="mean prompt tokens of part 1")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user", type=int, default=192, help="tokens of each turn's user message (> the window)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each part per layout, alternating (the median)")
    args = ap.parse_args()
    config = model_config(args)
    params = init_params(config, seed=0)
    print(
        f"{config.name}: {config.num_layers} layers (window {config.sliding_window}, every "
        f"{config.sliding_window_pattern}th global), hidden {config.hidden_size}, {config.num_kv_heads} KV heads x "
        f"{config.head_dim}; KV budget {args.kv_mib} MiB, pages of {args.page_size}, chunk {args.chunk}"
    )
    ok = True
    print()
    print(f"Throughput: {args.requests} requests, prompts {args.prompt} +- 25 %, {args.output} tokens out, greedy")
    print()
    print(f"tokens/s: median [range] of {args.repeat} runs per layout, alternating")
    print()
    print(
        "| layout | pages | page KiB | tokens/s | tokens per CPU-s | mean running seqs | peak pages | peak KV MiB | "
        "preemptions |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    engines = {name: engine(config, params, args, name == "hybrid") for name in ("hybrid", "full")}
    runs: dict[str, list[Throughput]] = {name: [] for name in engines}
    for _ in range(args.repeat):  # the layouts alternate, so a machine whose load changes slows them alike
        for name, e in engines.items():
            runs[name].append(throughput(e, config, args))
    res = {name: rs[0] for name, rs in runs.items()}
    for name, rs in runs.items():
        rate = statistics.median(r.tokens_per_s for r in rs)
        cpu_rate = statistics.median(r.tokens_per_cpu_s for r in rs)
        res[name] = dataclasses.replace(rs[0], tokens_per_s=rate, tokens_per_cpu_s=cpu_rate)
        assert all(r.outputs == rs[0].outputs for r in rs), "a repeated run gave other tokens"
    for name, r in res.items():
        rates = [x.tokens_per_s for x in runs[name]]
        print(
            f"| {name} | {r.pages} | {r.page_bytes / 1024:.0f} | {r.tokens_per_s:.1f} [{min(rates):.1f}-"
            f"{max(rates):.1f}] | {r.tokens_per_cpu_s:.1f} | {r.mean_running:.1f} | "
            f"{r.peak_pages} | {r.peak_pages * r.page_bytes / 2**20:.1f} | {r.preemptions} |"
        )
    h, f = res["hybrid"], res["full"]
    same = h.outputs == f.outputs
    ok &= same
    print(
        f"| hybrid / full | | | **{h.tokens_per_s / f.tokens_per_s:.2f}x** | "
        f"{h.tokens_per_cpu_s / f.tokens_per_cpu_s:.2f}x | {h.mean_running / f.mean_running:.2f}x | | | |"
    )
    print(f"identical greedy outputs: {same}")
    print()
    print(
        f"Multi-turn: {args.conversations} chats x {args.turns} turns, {args.user}-token user messages "
        f"(window {args.window}), {args.output} tokens out; turns after the first:"
    )
    print()
    print(f"TTFT p50: median [range] of {args.repeat} runs per layout, alternating")
    print()
    print("| layout | prompt tokens | prefix-cache hit rate | TTFT p50 |")
    print("|---|---:|---:|---:|")
    chats: dict[str, list[MultiTurn]] = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, e in engines.items():
            chats[name].append(multi_turn(e, args))
    turns = {name: ms[0] for name, ms in chats.items()}
    for name, ms in chats.items():
        assert all(m.outputs == ms[0].outputs and m.hit_rate == ms[0].hit_rate for m in ms), "a repeat differed"
        ttfts = [m.ttft_p50_ms for m in ms]
        print(
            f"| {name} | {ms[0].prompt_tokens} | {ms[0].hit_rate:.1%} | {statistics.median(ttfts):.1f} ms "
            f"[{min(ttfts):.1f}-{max(ttfts):.1f}] |"
        )
    same = turns["hybrid"].outputs == turns["full"].outputs
    ok &= same
    print(f"identical greedy outputs: {same}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

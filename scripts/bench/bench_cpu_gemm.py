"""End to end on CPU: the packed-weight GEMM (`paged_jax.model.cpu_weights`) on against off, side by side.

Per dtype, two engines in one process on the same model (the peers' 56M Llama by default: random weights, hidden
512, 8 layers, vocabulary 32,000), one with the CPU-weights record (the default) and one with
``PAGED_JAX_CPU_GEMM=0`` (XLA's dots):

- start-up: each engine's construction, wall and CPU seconds, and the packing inside it (`PackReport`);
- the peers' workload: `--batch` prompts of `--prompt-len` random ids, `--max-tokens` greedy new tokens with EOS
  ignored; one untimed run each (compiles), then `--rounds` runs alternating the engines (order flipped every
  round): generated tokens per wall second and per CPU second (this process's, all threads), medians and ranges;
- greedy tokens of the two compared, prompt by prompt.

    python -m scripts.bench.bench_cpu_gemm [--model DIR|JSON] [--dtypes float32 bfloat16] [--batch 32]
        [--prompt-len 128] [--max-tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from paged_jax import LLM, SamplingParams
from paged_jax.model.cpu_weights import ENV
from pallas_kernels.cpu import gemm
from scripts.bench.bench_cpu_step import PEER_56M

MODES = ("off", "on")


def engine(model: str, dtype: str, args, mode: str) -> tuple[LLM, float, float]:
    os.environ[ENV] = "1" if mode == "on" else "0"
    t0, c0 = time.perf_counter(), time.process_time()
    llm = LLM(
        model,
        dtype=dtype,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.batch,
        max_num_batched_tokens=1024,
        num_pages=args.batch * (-(-(args.prompt_len + args.max_tokens + 16) // 16)) + 1,
        warmup=False,
    )
    return llm, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="config JSON or HF dir; default: the peers' 56M Llama")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    model = args.model
    if model is None:
        model = str(Path(tempfile.mkdtemp()) / "peer-56m.json")
        Path(model).write_text(json.dumps(PEER_56M))
    lib = gemm.kernel()
    print(f"{os.cpu_count()} CPUs, GEMM ISA {lib.isa if lib else None}; load average before: {os.getloadavg()}")
    for dtype in args.dtypes:
        llms, startup = {}, {}
        for mode in MODES:
            llm, wall, cpu = engine(model, dtype, args, mode)
            llms[mode], startup[mode] = llm, (wall, cpu, llm.engine.runner.cpu_pack)
        vocab = llms["on"].config.vocab_size
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.prompt_len).tolist()} for _ in range(args.batch)]
        sp = SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True, detokenize=False
        )
        tokens, first = {}, {}
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            first[mode] = time.perf_counter() - t0
        rates: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llms[mode].generate(prompts, sp, use_tqdm=False)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                gen = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[mode].append((gen / wall, gen / cpu))
                print(
                    f"{dtype} round {r} gemm {mode}: {gen / wall:.1f} tok/s wall, {gen / cpu:.1f} tok/CPU-s", flush=True
                )
        print(
            f"\n{dtype}: {'gemm':<5} {'tok/s wall (range)':>24} {'tok/CPU-s (range)':>24} {'start-up s wall/CPU':>20}"
        )
        med = {}
        for mode in MODES:
            w, c = [x for x, _ in rates[mode]], [y for _, y in rates[mode]]
            med[mode] = (float(np.median(w)), float(np.median(c)))
            sw, sc, pack = startup[mode]
            packed = f"  packing {pack.seconds:.2f} s wall, {pack.cpu_seconds:.2f} s CPU" if pack else ""
            print(
                f"{'':9s}{mode:<5} {med[mode][0]:8.1f} ({min(w):.0f}-{max(w):.0f}) {'':6s} {med[mode][1]:8.1f} "
                f"({min(c):.0f}-{max(c):.0f}) {'':6s} {sw:6.2f} / {sc:5.2f}  first run {first[mode]:.1f} s{packed}"
            )
        on, off = med["on"], med["off"]
        same = sum(a == b for a, b in zip(tokens["on"], tokens["off"], strict=True))
        print(f"  on / off: {on[0] / off[0]:.2f}x wall, {on[1] / off[1]:.2f}x per CPU-s (medians of {args.rounds})")
        print(f"  greedy tokens equal on {same} of {len(prompts)} prompts")
        del llms
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

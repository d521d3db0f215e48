"""Multi-LoRA benchmarks, side by side in one run (these CPUs are shared and noisy: rounds alternate).

1. delta: the batched LoRA delta of one projection two ways, at decode (T = 32) and prefill (T = 256) sizes,
   SmolLM2-135M's q/k/v shapes, rank 16, 4 adapter slots (tokens spread over them and slot 0): the one-hot
   shrink/expand over every slot that `paged_jax.lora.delta` uses, and a gather of each token's own A and B
   (`A[slots]` [T, H, 3, R], BGMV by gather). Median milliseconds per call.
2. decode: generated tokens/s at batch 32 (32 requests, 16-token prompts, 64 new tokens (`--new-tokens`), greedy,
   EOS ignored; timed from the step where every request has its first token to the last) on SmolLM2-135M-Instruct
   and the peers' 56M Llama shape (random weights of ../shared/peers/make_model.py's config): the engine without LoRA,
   with LoRA on and no adapter in use, with one adapter for all 32 requests, and with four distinct adapters
   spread over the batch (rank 16, every projection adapted, max_loras 4). The ratio to the base engine is the
   figure the issue asks for (goal: four adapters >= 0.8x). One untimed pass of each case compiles the shapes the
   timed rounds use (no full warm-up), and the rounds must compile nothing.
3. bytes: what a LoRA step with an adapter reads beyond the base model (the A and B arrays of every slot,
   every layer: the one-hot formulation reads all slots whatever the batch holds; a step without adapters reads
   none), against the base weights' bytes.

    .venv/bin/python scripts/bench/bench_lora.py [--sections delta,decode,bytes] [--rounds 3] [--models smollm2,peers]
        [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]

from paged_jax.config import ModelConfig  # noqa: E402
from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.lora import LoRARequest  # noqa: E402
from paged_jax.lora import delta as lora_delta  # noqa: E402
from paged_jax.lora import weights as lw  # noqa: E402
from paged_jax.lora.random_adapter import write_adapter  # noqa: E402
from paged_jax.model.init import init_params  # noqa: E402
from paged_jax.model.layers import split_qkv  # noqa: E402
from paged_jax.sampling_params import SamplingParams  # noqa: E402
from paged_jax.tokenization.tokenizer import ByteTokenizer  # noqa: E402

RANK = 16
BATCH = 32
PEERS = ModelConfig(
    name="peers-56m",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    max_position_embeddings=2048,
    eos_token_ids=(2,),
)


def median_ms(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_delta(rounds: int) -> None:
    h, hq, hkv, d, s = 576, 9, 3, 64, 4
    rng = np.random.default_rng(0)
    f32 = np.float32
    qkv_a = jnp.asarray(rng.standard_normal((h, 3, s, RANK)), f32)
    bs = [jnp.asarray(rng.standard_normal((s, RANK, n, d)), f32) for n in (hq, hkv, hkv)]
    scaling = jnp.asarray([2.0] * s, f32)

    g = hq // hkv  # qkv_b [G + 2, S, R, Hkv, D]: query head h * G + k at [k, ..., h], then K, then V
    q_b = bs[0].reshape(s, RANK, hkv, g, d).transpose(3, 0, 1, 2, 4)
    qkv_b = jnp.concatenate([q_b, bs[1][None], bs[2][None]], axis=0)

    @jax.jit
    def one_hot(x, slots):
        weights = {"qkv_a": qkv_a, "qkv_b": qkv_b}
        lora = lora_delta.LoraLayer(weights, lora_delta.token_weights(slots, scaling), jnp.any(slots > 0))
        zeros = jnp.zeros((x.shape[0], hkv, g + 2, d), f32)  # the deltas alone, in the fused layout
        return split_qkv(lora_delta.add_qkv(x, zeros, lora))

    @jax.jit
    def gather(x, slots):
        index = jnp.maximum(slots - 1, 0)  # slot 0 has no arrays: its scale is 0
        a = jnp.take(qkv_a, index, axis=2)  # [H, 3, T, R]
        scale = jnp.where(slots > 0, scaling[index], 0.0)
        u = jnp.einsum("th,hktr->tkr", x, a) * scale[:, None, None]
        return tuple(jnp.einsum("tr,trnd->tnd", u[:, j], jnp.take(b, index, axis=0)) for j, b in enumerate(bs))

    print(f"\n1. delta of q/k/v (SmolLM2 shapes, rank 16, {s} adapter slots), median ms per call")
    print("tokens  one-hot  gather  gather/one-hot")
    for t in (32, 256):
        x = jnp.asarray(rng.standard_normal((t, h)), f32)
        slots = jnp.asarray(rng.integers(0, s + 1, t), jnp.int32)
        for a, b in zip(one_hot(x, slots), gather(x, slots), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3)
        oh, ga = [], []
        for _ in range(rounds):
            oh.append(median_ms(one_hot, x, slots))
            ga.append(median_ms(gather, x, slots))
        o, g = statistics.median(oh), statistics.median(ga)
        print(f"{t:6d}  {o:7.3f}  {g:6.3f}  {g / o:6.2f}x")


def model(name: str):
    if name == "smollm2":
        config, params, _ = load_model("smollm2-135m-instruct")
        return config, params
    return PEERS, init_params(PEERS, seed=0)


def decode_tok_s(engine: LLMEngine, loras: list[LoRARequest | None], new_tokens: int = 64) -> float:
    """Decode tokens/s of BATCH requests whose adapters are `loras[i % len(loras)]`."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(BATCH):
        engine.add_request(f"r{i}", rng.integers(3, 250, 16).tolist(), params, lora_request=loras[i % len(loras)])
    started: set[str] = set()
    t0 = tokens = None
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            started.add(out.request_id)
            if t0 is not None:
                tokens += len(out.outputs[0].new_token_ids)
        if t0 is None and len(started) == BATCH:
            t0, tokens = time.perf_counter(), 0
    return tokens / (time.perf_counter() - t0)


def bench_decode(names: list[str], rounds: int, new_tokens: int) -> None:
    print(f"\n2. decode tokens/s at batch 32, {new_tokens} new tokens (rank 16, every projection adapted)")
    print("model     base   lora-on/0  1 adapter  4 adapters   (ratios to base)")
    for name in names:
        config, params = model(name)
        with tempfile.TemporaryDirectory() as tmp:
            loras = [
                LoRARequest(
                    f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", config, rank=RANK, seed=i, std=0.05))
                )
                for i in range(4)
            ]
            common = dict(
                max_num_seqs=BATCH, max_num_batched_tokens=512, max_model_len=256, num_pages=1 + BATCH * 6, warmup=False
            )
            base = LLMEngine(config, params, ByteTokenizer(), EngineConfig(**common))
            lora = LLMEngine(
                config,
                params,
                ByteTokenizer(),
                EngineConfig(**common, enable_lora=True, max_loras=4, max_lora_rank=RANK),
            )
            cases = {
                "base": (base, [None]),
                "lora0": (lora, [None]),
                "lora1": (lora, loras[:1]),
                "lora4": (lora, loras),
            }
            for engine, adapters in cases.values():  # compiles the shapes the timed rounds use (no full warm-up)
                decode_tok_s(engine, adapters, new_tokens)
            compiled = lora.runner.compile_stats.count
            runs = {name: [] for name in cases}
            for _ in range(rounds):
                for case, (engine, adapters) in cases.items():
                    runs[case].append(decode_tok_s(engine, adapters, new_tokens))
            assert lora.runner.compile_stats.count == compiled, lora.runner.compile_stats  # none while timed
        med = {k: statistics.median(v) for k, v in runs.items()}
        b = med["base"]
        print(
            f"{name:8s} {b:6.0f}  {med['lora0']:6.0f}     {med['lora1']:6.0f}     {med['lora4']:6.0f}"
            f"      ({med['lora0'] / b:.2f} / {med['lora1'] / b:.2f} / {med['lora4'] / b:.2f})"
        )


def bench_bytes(names: list[str]) -> None:
    print("\n3. bytes a LoRA step reads beyond the base model (4 adapters resident, rank 16, every projection)")
    for name in names:
        config, params = model(name)
        shapes = lw.abstract_weights(config, 4, RANK, stacked=False)
        extra = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
        base = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        print(
            f"{name}: {extra / 2**20:.1f} MiB of adapter slots ({config.dtype}) against {base / 2**20:.1f} MiB of "
            f"weights: +{100 * extra / base:.1f}% weight bytes per step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="delta,decode,bytes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="smollm2,peers")
    parser.add_argument("--new-tokens", type=int, default=64, help="per request in the decode section")
    args = parser.parse_args()
    sections, names = args.sections.split(","), args.models.split(",")
    if "delta" in sections:
        bench_delta(args.rounds)
    if "decode" in sections:
        bench_decode(names, args.rounds, args.new_tokens)
    if "bytes" in sections:
        bench_bytes(names)


if __name__ == "__main__":
    main()

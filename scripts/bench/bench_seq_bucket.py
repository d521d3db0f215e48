"""Does the sequence bucket buy speed? Times the forward step of one token bucket with different sequence buckets.

The step's token-level work (embedding, projections, RoPE, KV write, MLP) depends on the token bucket T only;
the sequence bucket S sizes the attention metadata (whose padding rows cost nothing: the XLA attention's loops
have runtime trip counts), the attention plan's rows per chunk, and the rows of the LM head. This script runs
the same real work (a prefill of one prompt, a decode of T sequences, or a mix) under S = the smallest bucket
that holds it and under S = max_num_seqs' bucket, and prints the time per step of each, so the runner can
drop S as a shape dimension where it does not pay. Timings on a shared machine are noisy: the two variants
are run interleaved and the ratio is what to read.

    python scripts/bench/bench_seq_bucket.py [--layers 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.model.init import init_params
from paged_jax.worker.paged_attention import PagedMeta
from paged_jax.worker.step_functions import StepKey, step_functions
from pallas_kernels.common import cdiv, kv_pages_shape


def smollm_like(layers: int, vocab: int = 49152) -> ModelConfig:
    """SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads, head_dim 64, vocab 49152) with `layers` layers."""
    return ModelConfig(
        name="smollm-like",
        vocab_size=vocab,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        eos_token_ids=(0,),
        bos_token_id=1,
    )


def case_inputs(kind: str, t: int, s: int, page_size: int, max_blocks: int):
    """Metadata of one step of real work padded to (t, s): 'prefill' (one prompt of t tokens), 'decode' (t
    sequences of one token at context 512) or 'mixed' (t/16 decodes, then one prompt chunk of the rest)."""
    if kind == "prefill":
        lens = [(t, t)]  # (q_len, kv_len)
    elif kind == "decode":
        lens = [(1, 512)] * t
    else:
        lens = [(1, 512)] * (t // 16) + [(t - t // 16, t - t // 16)]
    assert len(lens) <= s
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    slots = np.full(t, -1, np.int32)
    kv_lens, cu = np.zeros(s, np.int32), np.zeros(s + 1, np.int32)
    tables = np.zeros((s, max_blocks), np.int32)
    off, page = 0, 1
    for i, (q, kv) in enumerate(lens):
        n_blocks = cdiv(kv, page_size)
        tables[i, :n_blocks] = np.arange(page, page + n_blocks)
        page += n_blocks
        pos = np.arange(kv - q, kv, dtype=np.int32)
        positions[off : off + q] = pos
        tokens[off : off + q] = 3 + pos % 100
        slots[off : off + q] = tables[i, pos // page_size] * page_size + pos % page_size
        off += q
        kv_lens[i], cu[i + 1] = kv, off
    cu[len(lens) + 1 :] = off
    logits_idx = np.zeros(s, np.int32)
    logits_idx[: len(lens)] = cu[1 : len(lens) + 1] - 1
    meta = PagedMeta(slots, kv_lens, tables, cu, np.array([len(lens)], np.int32))
    return (tokens, positions, meta, logits_idx), page


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152, help="a small vocabulary takes the LM head out")
    args = ap.parse_args()
    config = smollm_like(args.layers, args.vocab)
    params = init_params(config)
    page_size, max_blocks = 16, 2048 // 16
    _, forward = step_functions(StepKey(config, "xla"))
    cases = [
        ("decode", 16, 16),
        ("decode", 32, 32),
        ("prefill", 64, 8),
        ("prefill", 256, 8),
        ("mixed", 256, 32),
        ("mixed", 64, 8),
    ]
    print(
        f"model: {config.name}, {args.layers} layers, vocab {config.vocab_size}; "
        f"max_num_seqs {args.max_num_seqs}; {jax.devices()[0]}"
    )
    print(f"{'case':8} {'T':>4} {'S':>4} {'S=max':>6} {'ms (S small)':>13} {'ms (S=max)':>11} {'ratio':>6}")
    for kind, t, s_small in cases:
        results = {}
        variants = {"small": s_small, "max": max(s_small, args.max_num_seqs)}
        inputs = {}
        for name, s in variants.items():
            inputs[name], pages = case_inputs(kind, t, s, page_size, max_blocks)
        kv = tuple(
            np.zeros(kv_pages_shape(pages + 1, config.num_kv_heads, page_size, config.head_dim), np.float32)
            for _ in range(config.num_layers)
        )
        kv = jax.device_put(kv)
        times = {name: [] for name in variants}
        for name in variants:  # compile outside the timing
            out, kv, _ = forward(params, kv, *inputs[name])
            jax.block_until_ready(out)
        for _ in range(args.rounds):
            for name in variants:
                t0 = time.perf_counter()
                out, kv, _ = forward(params, kv, *inputs[name])
                jax.block_until_ready(out)
                times[name].append(time.perf_counter() - t0)
        for name in variants:
            results[name] = statistics.median(times[name]) * 1e3
        print(
            f"{kind:8} {t:4d} {s_small:4d} {variants['max']:6d} {results['small']:13.2f} {results['max']:11.2f} "
            f"{results['max'] / results['small']:6.2f}"
        )


if __name__ == "__main__":
    main()

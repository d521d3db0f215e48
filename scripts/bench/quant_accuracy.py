"""Accuracy of quantized weights and KV pages against the unquantized model, on a fixed text.

For each mode it runs the model over ``--chunks`` windows of ``--window`` tokens of a fixed text (a Python
standard-library source file, the same bytes on every machine with Python 3.12) and compares the next-token
distributions with the float model's at every position: max |logit error| (absolute, and relative to the
largest |logit|), mean KL(float || quantized), top-1 agreement, and the perplexity of the text under each.

KV modes run the model's attention over K/V rounded exactly as ``write_kv`` stores them
(:func:`pallas_kernels.kv_quant.quantize`, then dequantized); every paged backend is tested to compute exactly
that attention on the stored values (``tests/kernels/xla/test_kv_quant.py``), so this is the engine's KV error without
its paging. Weight modes use the model's own quantized matmul (``paged_jax.model.quant.dot``): ``w-int8``
(``--quantization int8``) casts the weight to the activation dtype, ``w-w8a8`` (``--quantization w8a8``)
quantizes the activations per token too and multiplies int8 x int8 (fast on CPU), ``w-fp8`` casts e4m3
weights.

    python scripts/bench/quant_accuracy.py /tmp/paged_jax_peers/model --window 1024 --chunks 4
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.model import quant  # noqa: E402
from paged_jax.model.attention import DenseMeta, dense_attention  # noqa: E402
from paged_jax.model.llama import LlamaForCausalLM  # noqa: E402
from pallas_kernels import kv_quant  # noqa: E402

TEXT_FILE = os.path.join(os.path.dirname(os.__file__), "argparse.py")
# mode -> (weight quantization, native int8 dot, KV dtype)
MODES = {
    "kv-int8": (None, False, jnp.int8),
    "kv-fp8": (None, False, jnp.float8_e4m3fn),
    "w-int8": ("int8", False, None),
    "w-w8a8": ("w8a8", True, None),
    "w-fp8": ("fp8", False, None),
    "w-w8a8+kv-int8": ("w8a8", True, jnp.int8),
}


def kv_rounded_attention(q, k, v, kv_cache, meta, *, sm_scale, kv_dtype, **layer_options):
    """Dense attention over K/V quantized per (token, head) and dequantized, as the pages hold them."""
    kq, ks = kv_quant.quantize(k, kv_dtype)
    vq, vs = kv_quant.quantize(v, kv_dtype)
    k = (kq.astype(jnp.float32) * ks[..., None]).astype(k.dtype)
    v = (vq.astype(jnp.float32) * vs[..., None]).astype(v.dtype)
    return dense_attention(q, k, v, kv_cache, meta, sm_scale=sm_scale, **layer_options)


def log_probs_fn(config, kv_dtype):
    attn = dense_attention if kv_dtype is None else functools.partial(kv_rounded_attention, kv_dtype=kv_dtype)
    model = LlamaForCausalLM(config, attention_fn=attn)

    @jax.jit
    def run(params, tokens):
        n = tokens.shape[0]
        hidden, _ = model.apply(params, tokens, jnp.arange(n, dtype=jnp.int32), None, DenseMeta.single(n))
        logits = model.apply(params, hidden, method=LlamaForCausalLM.compute_logits)
        return logits, jax.nn.log_softmax(logits, axis=-1)

    return run


def measure(model_dir: str, window: int, chunks: int, modes: list[str]) -> list[dict]:
    config, params, tokenizer = load_model(model_dir)
    ids = tokenizer.encode(open(TEXT_FILE).read(), add_special_tokens=False)
    window = min(window, config.max_position_embeddings)
    need = window * chunks + 1
    if len(ids) < need:
        raise SystemExit(f"{TEXT_FILE}: {len(ids)} tokens, need {need}")
    windows = [np.asarray(ids[i * window : (i + 1) * window + 1], np.int32) for i in range(chunks)]
    ref_fn = log_probs_fn(config, None)
    refs = [ref_fn(params, jnp.asarray(w[:-1])) for w in windows]
    rows = [_row("float", refs, refs, windows)]
    for mode in modes:
        wq, native, kv_dtype = MODES[mode]
        p = quant.quantize_params(params, wq, native_dot=native) if wq else params
        fn = log_probs_fn(config, kv_dtype)
        rows.append(_row(mode, refs, [fn(p, jnp.asarray(w[:-1])) for w in windows], windows))
    return rows


def _row(mode, refs, outs, windows) -> dict:
    max_err = rel_err = kl_sum = agree = nll_sum = 0.0
    n = 0
    for (ref_logits, ref_lp), (logits, lp), w in zip(refs, outs, windows, strict=True):
        ref_logits, ref_lp, logits, lp = (np.asarray(x, np.float64) for x in (ref_logits, ref_lp, logits, lp))
        err = np.max(np.abs(logits - ref_logits))
        max_err = max(max_err, err)
        rel_err = max(rel_err, err / np.max(np.abs(ref_logits)))
        kl_sum += float(np.sum(np.exp(ref_lp) * (ref_lp - lp)))
        agree += int(np.sum(np.argmax(logits, -1) == np.argmax(ref_logits, -1)))
        nll_sum += -float(np.sum(lp[np.arange(len(w) - 1), w[1:]]))
        n += len(w) - 1
    return {
        "mode": mode,
        "positions": n,
        "max_logit_err": max_err,
        "max_logit_err_rel": rel_err,
        "mean_kl": kl_sum / n,
        "top1": agree / n,
        "ppl": float(np.exp(nll_sum / n)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model directories (HF) or names")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    print("| model | mode | positions | max logit err (rel) | mean KL | top-1 agree | perplexity |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        start = time.perf_counter()
        for r in measure(model, args.window, args.chunks, args.modes):
            print(
                f"| {os.path.basename(model.rstrip('/'))} | {r['mode']} | {r['positions']} | "
                f"{r['max_logit_err']:.4f} ({100 * r['max_logit_err_rel']:.2f}%) | {r['mean_kl']:.2e} | "
                f"{100 * r['top1']:.2f}% | {r['ppl']:.3f} |",
                flush=True,
            )
        print(f"<!-- {model}: {time.perf_counter() - start:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

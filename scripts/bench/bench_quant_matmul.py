"""Which int8 matmul to use on this CPU: the float weight, the int8 weight cast to the activation dtype (scale on
the output), or an int8 x int8 dot with per-token int8 activations (int32 accumulation). Side by side in
alternating rounds (the CPUs are shared), medians, ratios to the float weight.

    python scripts/bench/bench_quant_matmul.py [--k 2048 --n 8192 --tokens 16 64 256 --rounds 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from paged_jax.model import quant  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256])
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    w = jax.random.normal(jax.random.key(0), (args.k, args.n)) * 0.02
    cast = quant.quantize_weight(w, 1, "int8", native_dot=False)
    native = quant.quantize_weight(w, 1, "int8", native_dot=True)
    dot = jax.jit(quant.dot)
    print(f"[T, {args.k}] x [{args.k}, {args.n}], median of {args.rounds}, load {os.getloadavg()[0]:.1f}")
    print(
        f"{'dtype':<10}{'T':>6}{'float ms':>10}{'cast ms':>10}{'int8 dot ms':>12}{'cast/float':>11}{'int8/float':>11}"
    )
    for dtype in args.dtypes:
        for t in args.tokens:
            x = jax.random.normal(jax.random.key(1), (t, args.k)).astype(dtype)
            runs = {"float": (x, w.astype(dtype)), "cast": (x, cast), "native": (x, native)}
            for a in runs.values():
                jax.block_until_ready(dot(*a))
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.rounds):
                for name, a in runs.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(dot(*a))
                    times[name].append(time.perf_counter() - t0)
            med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
            print(
                f"{dtype:<10}{t:>6}{med['float']:>10.2f}{med['cast']:>10.2f}{med['native']:>12.2f}"
                f"{med['cast'] / med['float']:>10.2f}x{med['native'] / med['float']:>10.2f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of the C++ CPU attention kernel: another build of it (a library from the kernel cache, e.g. one built from
an older commit) against the current sources' build, on the same decode operands in one process, calls
alternating; median CPU ms per call (CPU time moves less than wall time with other work on shared cores), the
ratio, and the largest output difference over all layers (0 when a change keeps the arithmetic).

    .venv/bin/python scripts/bench/bench_kernel_ab.py OLD.so [--reps 20] [--layers 8]

One call's pages (a few MB at the model shapes) stay in L3 between calls, which a model's decode step never
sees: its other layers' pages and its weights pass through the caches between two reads of a layer's pages.
`--layers N` runs each case as N layers, each with its own pages, in one jitted call (as the step does; at most as
many layers as 96 MB of pages need, so the long cases stay one layer), and reports CPU ms per layer.

Keep the old library before editing the sources: `cp ~/.cache/paged-jax/kernels/paged_attention-native-*.so`
(the newest one is the current build; `pallas_kernels.cpu.paged.kernel().library` names it).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_paged  # noqa: E402
from pallas_kernels.common import kv_pages_shape  # noqa: E402

# (batch, context, KV heads, group, head_dim): the peers' 56M and SmolLM2 decode shapes, a long batch, batch 1.
CASES = [(32, 192, 4, 2, 64), (32, 192, 3, 3, 64), (32, 2048, 4, 2, 64), (1, 16384, 4, 2, 64)]
PAGE = 16


def layers_step(q, kvs, *meta, k: cpu_paged.Kernel, sm_scale: float) -> list[jax.Array]:
    """The kernel `k` over each layer's pages in `kvs` (one query, as the benchmark's layers share it)."""
    return [cpu_paged.call(k, q, kv, *meta, sm_scale=sm_scale) for kv in kvs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="the other build of the kernel (.so)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=1, help="distinct KV caches per call (see above)")
    args = ap.parse_args()
    new = cpu_paged.kernel()
    if new is None:
        raise SystemExit("the current kernel cannot be built here")
    kernels = {"old": cpu_paged.load(Path(args.old), "paged_attention_ab_old"), "new": new}
    print(f"old {args.old}\nnew {new.library} ({new.isa}); load average {os.getloadavg()[0]:.1f}")
    rng = np.random.default_rng(0)
    for batch, context, kv_heads, group, d in CASES:
        blocks = -(-context // PAGE)
        num_pages = batch * blocks + 1
        tables = jnp.asarray(rng.permutation(np.arange(1, num_pages, dtype=np.int32)).reshape(batch, blocks))
        meta = (jnp.full((batch,), context, jnp.int32), tables, jnp.arange(batch + 1, dtype=jnp.int32))
        num_seqs = jnp.asarray([batch], jnp.int32)
        for dtype in (jnp.bfloat16, jnp.float32):
            shape = kv_pages_shape(num_pages, kv_heads, PAGE, d)
            layers = max(1, min(args.layers, (96 << 20) // (np.prod(shape) * jnp.dtype(dtype).itemsize)))
            kvs = [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(layers)]
            q = jnp.asarray(rng.standard_normal((batch, kv_heads * group, d), np.float32), dtype)
            fns = {n: jax.jit(functools.partial(layers_step, k=k, sm_scale=d**-0.5)) for n, k in kernels.items()}
            outs = {k: np.asarray(f(q, kvs, *meta, num_seqs), np.float32) for k, f in fns.items()}
            times: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(args.reps):
                for k, f in fns.items():
                    c0 = time.process_time()
                    jax.block_until_ready(f(q, kvs, *meta, num_seqs))
                    times[k].append((time.process_time() - c0) / layers)
            o, n = (float(np.median(times[k])) * 1e3 for k in ("old", "new"))
            diff = float(np.abs(outs["old"] - outs["new"]).max())
            print(
                f"b{batch} ctx{context} kv_heads {kv_heads} group {group} {jnp.dtype(dtype).name:8s}"
                f"{f' x{layers} layers' if args.layers > 1 else ''}: "
                f"old {o:.3f} new {n:.3f} CPU ms per call, {o / n:.2f}x; max |diff| {diff:.1e}"
            )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

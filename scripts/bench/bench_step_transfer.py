"""Is one packed host-to-device transfer of the step metadata worth it? Per-step host time, side by side.

The forward step takes its metadata as separate int32 arrays (token ids, positions, slot mapping, kv_lens, block
tables, cu_q_lens, num_seqs, logits indices: 8 arguments). tpu-inference packs them into one buffer and slices
on the device. This times, in one process and interleaved, the host side of both ways for the real step shapes:

- `separate`: a jitted function of the 8 numpy arrays (each transferred on its own at dispatch);
- `packed`: `np.concatenate` of the 8 arrays on the host, one jitted function of that buffer that slices it
  back into the 8 arrays on the device.

Both jitted functions compute the same small reduction of every array (so nothing is dead code and the result
proves the slices are right). "dispatch" is the time until the call returns (what the host pays before it can
prepare the next step); "round trip" also waits for the result. Ratios are packed / separate.

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench/bench_step_transfer.py [--max-model-len 2048] [--page-size 16]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import cdiv


def step_arrays(t: int, s: int, max_blocks: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random int32 metadata of one step: [T] x 3, [S], [S, max_blocks], [S + 1], [1], [S]."""
    i32 = lambda *shape: rng.integers(0, 1000, shape, dtype=np.int32)
    return [i32(t), i32(t), i32(t), i32(s), i32(s, max_blocks), i32(s + 1), i32(1), i32(s)]


def consume(arrays) -> jax.Array:
    return sum(jnp.sum(a * (i + 1)) for i, a in enumerate(arrays))


separate = jax.jit(lambda *arrays: consume(arrays))


def packed_fn(shapes: tuple[tuple[int, ...], ...]):
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.cumsum([0, *sizes])

    @jax.jit
    def packed(buf: jax.Array) -> jax.Array:
        return consume([buf[offsets[i] : offsets[i + 1]].reshape(shape) for i, shape in enumerate(shapes)])

    return packed


def time_calls(fn, make_args, reps: int, wait: bool) -> float:
    """Median seconds per call (args built inside the timed region, as a real step builds them)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(*make_args())
        if wait:
            out.block_until_ready()
        times.append(time.perf_counter() - t0)
        if not wait:
            out.block_until_ready()
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    max_blocks = cdiv(args.max_model_len, args.page_size)
    print(f"load average {os.getloadavg()[0]:.2f}; max_blocks {max_blocks}; median of {args.reps} calls, interleaved")
    print(
        f"{'T':>5} {'S':>4} {'sep dispatch us':>16} {'packed us':>10} {'ratio':>6} {'sep round us':>13} "
        f"{'packed us':>10} {'ratio':>6}"
    )
    for t, s in ((16, 8), (64, 32), (256, 64), (512, 64)):
        arrays = step_arrays(t, s, max_blocks, rng)
        packed = packed_fn(tuple(a.shape for a in arrays))
        flat = lambda arrays=arrays: (np.concatenate([a.ravel() for a in arrays]),)
        assert int(separate(*arrays)) == int(packed(*flat()))  # same answer: the slices are right
        res = {}
        for _ in range(3):  # interleave the two ways so load drifts hit both alike
            for name, fn, make in (("sep", separate, lambda arrays=arrays: arrays), ("packed", packed, flat)):
                for wait in (False, True):
                    res.setdefault((name, wait), []).append(time_calls(fn, make, args.reps // 3, wait))
        m = {k: float(np.median(v)) * 1e6 for k, v in res.items()}
        print(
            f"{t:>5} {s:>4} {m['sep', False]:>16.1f} {m['packed', False]:>10.1f} "
            f"{m['packed', False] / m['sep', False]:>6.2f} {m['sep', True]:>13.1f} {m['packed', True]:>10.1f} "
            f"{m['packed', True] / m['sep', True]:>6.2f}"
        )


if __name__ == "__main__":
    main()

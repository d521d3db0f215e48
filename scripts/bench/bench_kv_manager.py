"""Host time of the KV-cache manager's share of one engine step.

Each step: every one of ``--running`` decoding requests grows by one token (``allocate_slots``; a new page
every ``page_size`` steps, and a newly full block gets hashed and cached), then ``--admit`` new requests
with ``--prompt``-token prompts that share a ``--prefix``-token prefix are admitted (``lookup_prefix`` +
``admit`` of the rest of the prompt in one chunk), and the admitted requests from ``--keep`` steps ago
are freed. The same workload runs for each pool size, to show that the cost does not depend on it.

    .venv/bin/python scripts/bench/bench_kv_manager.py
    .venv/bin/python scripts/bench/bench_kv_manager.py --pools 10000 1000000 --steps 256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from paged_jax.kv_cache import KVCacheManager
from paged_jax.kv_cache.invariants import check_manager_invariants


def run(num_pages: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    t0 = time.perf_counter()
    m = KVCacheManager(num_pages=num_pages, page_size=args.page_size)
    init_ms = (time.perf_counter() - t0) * 1e3

    running: dict[str, list[int]] = {}
    for i in range(args.running):
        # Staggered lengths spread page crossings over the steps as in a real batch; --aligned puts all
        # 256 crossings (new page, block hashed and cached) into the same step: the worst case.
        length = args.decode_prompt + (0 if args.aligned else i % args.page_size)
        tokens = [rng.randrange(32000) for _ in range(length)]
        assert m.admit(f"d{i}", tokens, len(tokens)) is not None
        running[f"d{i}"] = tokens
    prefix = [rng.randrange(32000) for _ in range(args.prefix)]
    # Warm the shared prefix once, as an earlier request would have.
    assert m.admit("warm", prefix + [0], args.prefix + 1) is not None
    m.free("warm")

    admitted: list[list[str]] = []
    decode_ns: list[int] = []
    admit_ns: list[int] = []
    free_ns: list[int] = []
    step_ns: list[int] = []
    table_ns: list[int] = []
    hit_tokens = 0
    for step in range(args.steps):
        for tokens in running.values():
            tokens.append(rng.randrange(32000))
        prompts = [prefix + [rng.randrange(32000) for _ in range(args.prompt - args.prefix)] for _ in range(args.admit)]
        ids = [f"a{step}.{j}" for j in range(args.admit)]

        t0 = time.perf_counter_ns()
        for rid, tokens in running.items():
            if m.allocate_slots(rid, tokens, 1) is None:
                raise SystemExit(f"pool of {num_pages} pages too small for the workload")
        t1 = time.perf_counter_ns()
        for rid, prompt in zip(ids, prompts, strict=True):
            hit = m.lookup_prefix(prompt)
            cached = m.admit(rid, prompt, len(prompt) - hit)
            if cached is None:
                raise SystemExit(f"pool of {num_pages} pages too small for the workload")
            hit_tokens += cached
        t2 = time.perf_counter_ns()
        admitted.append(ids)
        if len(admitted) > args.keep:
            for rid in admitted.pop(0):
                m.free(rid)
        t3 = time.perf_counter_ns()
        for rid in running:
            m.page_ids(rid)
        t4 = time.perf_counter_ns()
        decode_ns.append(t1 - t0)
        admit_ns.append(t2 - t1)
        free_ns.append(t3 - t2)
        step_ns.append(t3 - t0)
        table_ns.append(t4 - t3)

    check_manager_invariants(m)
    stats = m.stats()
    ms = 1e-6
    return {
        "pages": num_pages,
        "init_ms": init_ms,
        "decode_ms": statistics.mean(decode_ns) * ms,
        "admit_ms": statistics.mean(admit_ns) * ms / max(args.admit, 1),
        "free_ms": statistics.mean(free_ns) * ms,
        "step_ms": statistics.mean(step_ns) * ms,
        "p50_ms": statistics.median(step_ns) * ms,
        "p99_ms": sorted(step_ns)[int(0.99 * (len(step_ns) - 1))] * ms,
        "tables_ms": statistics.mean(table_ns) * ms,
        "hit_rate": hit_tokens / (args.steps * args.admit * args.prompt) if args.admit else 0.0,
        "util": stats.slot_utilization,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", type=int, nargs="+", default=[10_000, 1_000_000], help="pool sizes (pages)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--running", type=int, default=256, help="decoding requests, +1 token each per step")
    p.add_argument("--decode-prompt", type=int, default=128, help="tokens of each decoding request at start")
    p.add_argument("--aligned", action="store_true", help="all decoding requests cross a page in the same step")
    p.add_argument("--admit", type=int, default=1, help="new requests admitted per step")
    p.add_argument("--prompt", type=int, default=2048, help="tokens per admitted prompt")
    p.add_argument("--prefix", type=int, default=1024, help="tokens of the prefix all admitted prompts share")
    p.add_argument("--keep", type=int, default=4, help="steps an admitted request lives before it is freed")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="runs per pool size; the fastest is shown")
    args = p.parse_args()

    cols = ["pages", "init_ms", "decode_ms", "admit_ms", "free_ms", "step_ms", "p50_ms", "p99_ms", "tables_ms"]
    print(
        f"{args.running} decoding requests +1 token/step, {args.admit} admission(s)/step of {args.prompt}-token "
        f"prompts sharing {args.prefix} tokens, page_size {args.page_size}, {args.steps} steps"
        + (", page crossings aligned" if args.aligned else "")
    )
    print("  ".join(f"{c:>10}" for c in cols) + f"  {'hit_rate':>8}")
    rows = []
    for pages in args.pools:
        row = min((run(pages, args) for _ in range(args.repeats)), key=lambda r: r["step_ms"])
        rows.append(row)
        cells = [f"{row['pages']:>10d}"] + [f"{row[c]:>10.3f}" for c in cols[1:]]
        print("  ".join(cells) + f"  {row['hit_rate']:>8.3f}")
    print(
        "step_ms = decode + admit + free (manager's share of a step); admit_ms is per admitted request;"
        " tables_ms = page_ids() of every running request (not in step_ms)."
    )
    if len(rows) > 1:
        ratio = rows[-1]["step_ms"] / rows[0]["step_ms"]
        print(f"step_ms ratio {rows[-1]['pages']} / {rows[0]['pages']} pages: {ratio:.2f}")


if __name__ == "__main__":
    main()

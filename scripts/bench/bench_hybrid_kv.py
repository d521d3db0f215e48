"""Hybrid KV memory, host only: the KV manager and the scheduler with a real model's layer pattern and KV budget.

Part 1 (capacity). For each workload (lognormal prompt and output lengths around ``--lengths`` tokens), the same
stream of requests runs through the scheduler twice, side by side: with KV cache groups (a window group's tables
keep only what its window reads; a page is ``slots_per_page`` layer slabs) and with full-length pages for every
layer (one group, a page of ``num_layers`` slabs), each sized from the same byte budget: a v5e chip's HBM
(``--hbm-gib``) times the memory fraction, less the bfloat16 weights. Steps are simulated (every sequence whose
prompt completed samples one token; nothing runs on a device). Reported: the mean number of running sequences
and the KV utilization (layer-token slots some layer can still read over the layer-token slots of the pages in use,
a window layer reading the last ``W - 1`` tokens), both after ``--warmup`` steps, and preemptions.

Part 2 (host time). ``--running`` decoding requests grow by one token per step (``allocate_slots``, then the
block tables the scheduler hands the runner: one gather of the manager's persistent tables): the median thread CPU
time per step with the model's groups against one group, the two layouts' steps alternating in one process, and
the ratio of both parts against the goal (<= 1.2x). ``--today TREE`` also times, in alternating runs, the same loop
against the manager from before KV cache groups (a checkout of that code: one table per request, handed to the
runner as ``page_ids`` lists, as its scheduler did).

    .venv/bin/python scripts/bench/bench_hybrid_kv.py
    .venv/bin/python scripts/bench/bench_hybrid_kv.py --model gemma-3-4b --lengths 8192 32768 --steps 3000
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from jax.tree_util import tree_leaves

from paged_jax.config import ModelConfig, load_model_config
from paged_jax.kv_cache import KVCacheManager, KVLayout, kv_layout
from paged_jax.model.init import param_shapes
from paged_jax.sampling_params import SamplingParams
from paged_jax.sched.scheduler import Scheduler
from paged_jax.sched.sequence import FinishReason, TokenSequence

GOALS = {8192: 3.5, 32768: 5.0}  # concurrent sequences, hybrid over full-length pages (issue 39)
UTILIZATION_GOAL = 0.90
HOST_GOAL = 1.2  # KV manager host time per step (allocation and block tables), hybrid over one group


@dataclass
class Capacity:
    pages: int
    mean_running: float
    utilization: float
    manager_utilization: float
    preemptions: int
    finished: int


def kv_bytes_per_layer_token(config: ModelConfig) -> int:
    return 2 * config.num_kv_heads * config.head_dim * 2  # K and V, bfloat16


def budget_bytes(config: ModelConfig, args: argparse.Namespace) -> int:
    weights = sum(math.prod(x.shape) for x in tree_leaves(param_shapes(config))) * 2
    return int((args.hbm_gib * 2**30 - weights) * args.memory_fraction)


def workload(length: int, count: int, seed: int, max_len: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): lognormal around 15/16 and 1/16 of `length`."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = min(max_len - 64, max(16, int(rng.lognormvariate(math.log(length * 15 / 16), 0.25))))
        output = min(max_len - prompt, max(8, int(rng.lognormvariate(math.log(length / 16), 0.25))))
        out.append(([rng.randrange(3, 200_000) for _ in range(prompt)], output))
    return out


def readable_slots(config: ModelConfig, computed: int) -> int:
    """Layer-token slots of a sequence with `computed` tokens that some future query still reads."""
    total = 0
    for layer in range(config.num_layers):
        w = config.layer_sliding_window(layer)
        total += computed if w is None else min(computed, w - 1)
    return total


def capacity(config: ModelConfig, layout: KVLayout, requests, args: argparse.Namespace) -> Capacity:
    page_bytes = layout.slots_per_page * args.page_size * kv_bytes_per_layer_token(config)
    num_pages = budget_bytes(config, args) // page_bytes
    chunk = args.chunk
    kv = KVCacheManager(num_pages, args.page_size, groups=layout.groups, max_step_tokens=chunk)
    sched = Scheduler(kv, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=chunk, chunk_size=chunk)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    pending = list(requests)
    wanted: dict[str, int] = {}
    running_counts, util, manager_util = [], [], []
    finished = 0
    for step in range(args.steps):
        while len(sched.waiting) < 4 and pending:  # keep the queue full: memory, not arrivals, bounds concurrency
            prompt, output = pending.pop(0)
            seq = TokenSequence(f"s{len(wanted)}", f"s{len(wanted)}", 0, prompt, params, 0)
            wanted[seq.seq_id] = len(prompt) + output
            sched.add(seq, [])
        out = sched.schedule()
        for item in out.scheduled:
            seq = item.seq
            if kv.num_computed_tokens(seq.seq_id) < seq.num_tokens:
                continue  # a prompt chunk short of the last token samples nothing
            seq.append_token(7)
            if seq.num_tokens >= wanted[seq.seq_id]:
                sched.remove(seq, FinishReason.LENGTH)
                finished += 1
        if step >= args.warmup:
            running_counts.append(len(sched.running))
            if step % args.sample_every == 0:
                in_use = kv.num_pages - 1 - kv.num_free_pages()
                read = sum(readable_slots(config, kv.num_computed_tokens(s.seq_id)) for s in sched.running)
                util.append(read / (in_use * args.page_size * layout.slots_per_page) if in_use else 1.0)
                manager_util.append(kv.stats().kv_utilization)
    return Capacity(
        num_pages,
        statistics.fmean(running_counts),
        statistics.fmean(util),
        statistics.fmean(manager_util),
        sched.num_preemptions,
        finished,
    )


class HostRun:
    """``--running`` decoding requests of one layout in one manager, grown one token per step."""

    def __init__(self, layout: KVLayout, args: argparse.Namespace) -> None:
        rng = random.Random(0)
        blocks = -(-(args.decode_len + args.page_size + args.host_steps) // args.page_size)
        self.kv = KVCacheManager(args.running * len(layout.groups) * blocks + 2, args.page_size, groups=layout.groups)
        self.tokens: dict[str, list[int]] = {}
        for i in range(args.running):
            n = args.decode_len + i % args.page_size  # staggered: page crossings spread over the steps
            self.tokens[f"d{i}"] = [rng.randrange(200_000) for _ in range(n)]
            assert self.kv.admit(f"d{i}", self.tokens[f"d{i}"], n) is not None
        self.ids = list(self.tokens)
        self.rng = rng

    def step(self) -> tuple[int, int]:
        """ns of `allocate_slots` for every request, and of the block tables handed to the runner."""
        kv = self.kv
        for t in self.tokens.values():
            t.append(self.rng.randrange(200_000))
        t0 = time.thread_time_ns()
        for rid, t in self.tokens.items():
            if kv.allocate_slots(rid, t, 1) is None:
                raise SystemExit("host-time pool too small")
        t1 = time.thread_time_ns()
        kv.step_tables(self.ids)  # what `Scheduler.schedule` hands the runner: one gather of the persistent tables
        return t1 - t0, time.thread_time_ns() - t1


def host_time(layouts: dict[str, KVLayout], args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per layout, the median thread CPU ns per step of `allocate_slots` and of the step's block tables. The
    layouts' steps alternate, so a machine whose load changes slows them alike; the first steps (the admitted
    prompts' window drops) are left out."""
    runs = {name: HostRun(lay, args) for name, lay in layouts.items()}
    times: dict[str, list[tuple[int, int]]] = {name: [] for name in runs}
    for i in range(args.host_steps):
        for name, run in runs.items():
            t = run.step()
            if i >= 4:
                times[name].append(t)
    return {
        name: (statistics.median(a for a, _ in ts), statistics.median(b for _, b in ts)) for name, ts in times.items()
    }


# The decoding loop of `HostRun` against the KV manager from before KV cache groups (one table per request, handed to
# the runner as `page_ids` lists, as that scheduler did), run in a subprocess over that tree's `paged_jax`. Prints the
# median ns per step of `allocate_slots` and of the block tables.
TODAY_CHILD = """
import random, statistics, sys, time
from paged_jax.kv_cache import KVCacheManager
running, decode_len, ps, steps = map(int, sys.argv[1:5])
rng = random.Random(0)
blocks = -(-(decode_len + ps + steps) // ps)
kv = KVCacheManager(running * blocks + 2, ps)
tokens = {}
for i in range(running):
    n = decode_len + i % ps
    tokens[f"d{i}"] = [rng.randrange(200_000) for _ in range(n)]
    assert kv.admit(f"d{i}", tokens[f"d{i}"], n) is not None
ids = list(tokens)
times = []
for step in range(steps):
    for t in tokens.values():
        t.append(rng.randrange(200_000))
    t0 = time.thread_time_ns()
    for rid, t in tokens.items():
        assert kv.allocate_slots(rid, t, 1) is not None
    t1 = time.thread_time_ns()
    [kv.page_ids(rid) for rid in ids]
    if step >= 4:
        times.append((t1 - t0, time.thread_time_ns() - t1))
print(statistics.median(a for a, _ in times), statistics.median(b for _, b in times))
"""


def host_time_today(tree: str, args: argparse.Namespace) -> tuple[float, float]:
    """`TODAY_CHILD` over the `paged_jax` of `tree` (a checkout from before KV cache groups): median ns per step of
    `allocate_slots` and of the block tables."""
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    argv = [str(x) for x in (args.running, args.decode_len, args.page_size, args.host_steps)]
    out = subprocess.run(
        [sys.executable, "-c", TODAY_CHILD, *argv], env=env, check=True, capture_output=True, text=True, cwd=tree
    )
    a, b = out.stdout.split()
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-4b", help="a shipped config (its layers, KV heads, window)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192, 32768], help="none: the host-time part only")
    ap.add_argument("--hbm-gib", type=float, default=16.0, help="one chip's HBM (v5e: 16)")
    ap.add_argument("--memory-fraction", type=float, default=0.9)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="token budget and prompt chunk per step")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--running", type=int, default=256, help="decoding requests of the host-time part")
    ap.add_argument("--decode-len", type=int, default=2048)
    ap.add_argument("--host-steps", type=int, default=200)
    ap.add_argument(
        "--today",
        metavar="TREE",
        help="also time the KV manager from before KV cache groups, in a copy of that tree (mkdir TREE && git "
        "archive 42dd5e3 paged_jax | tar -x -C TREE): runs of both alternate, --today-runs times",
    )
    ap.add_argument("--today-runs", type=int, default=3)
    args = ap.parse_args()

    config = load_model_config(args.model)
    hybrid, full = kv_layout(config), kv_layout(config, hybrid=False)
    print(
        f"{args.model}: {config.num_layers} layers, window {config.sliding_window}; {len(hybrid.groups)} KV cache "
        f"groups of <= {hybrid.slots_per_page} layers; KV budget {budget_bytes(config, args) / 2**30:.2f} GiB "
        f"({args.hbm_gib:g} GiB HBM x {args.memory_fraction:g} less bf16 weights), pages of {args.page_size}"
    )
    print()
    print("| length | layout | pages | mean running seqs | KV utilization | preemptions | finished |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    ok = True
    for length in args.lengths:
        requests = workload(length, args.requests, 1, 4 * length)
        res = {name: capacity(config, lay, requests, args) for name, lay in (("hybrid", hybrid), ("full", full))}
        for name, r in res.items():
            print(
                f"| {length} | {name} | {r.pages} | {r.mean_running:.1f} | {r.utilization:.1%} | {r.preemptions} | "
                f"{r.finished} |"
            )
        ratio = res["hybrid"].mean_running / res["full"].mean_running
        goal = GOALS.get(length)
        util = res["hybrid"].utilization
        good = (goal is None or ratio >= goal) and util >= UTILIZATION_GOAL
        ok &= good
        print(
            f"|  | hybrid / full | | **{ratio:.2f}x** (goal >= {goal}x) | goal >= {UTILIZATION_GOAL:.0%} "
            f"(manager's own: {res['hybrid'].manager_utilization:.1%}) | | {'met' if good else 'MISSED'} |"
        )
    print()
    print(
        f"Host time per step, {args.running} decoding requests of ~{args.decode_len} tokens (median thread CPU time, "
        "layouts alternating):"
    )
    print()
    print("| layout | groups | allocate_slots | block tables | both |")
    print("|---|---:|---:|---:|---:|")
    layouts = {"hybrid": hybrid, "one group": full}
    times = host_time(layouts, args)
    for name, (a, t) in times.items():
        groups = len(layouts[name].groups)
        print(f"| {name} | {groups} | {a / 1e3:.0f} us | {t / 1e3:.0f} us | {(a + t) / 1e3:.0f} us |")
    a_ratio = times["hybrid"][0] / times["one group"][0]
    t_ratio = times["hybrid"][1] / times["one group"][1]
    both = sum(times["hybrid"]) / sum(times["one group"])
    good = both <= HOST_GOAL
    print(
        f"| hybrid / one group | | {a_ratio:.2f}x | {t_ratio:.2f}x | **{both:.2f}x** (goal <= {HOST_GOAL}x): "
        f"{'met' if good else 'MISSED'} |"
    )
    ok &= good
    if args.today:
        print()
        print(
            f"Against the KV manager from before KV cache groups ({args.today}: one table per request, handed as "
            f"page_ids lists), {args.today_runs} alternating runs, median [range] of their per-step medians:"
        )
        hybrid_runs, today_runs = [sum(times["hybrid"])], []
        for i in range(args.today_runs):
            today_runs.append(sum(host_time_today(args.today, args)))
            if i:
                hybrid_runs.append(sum(host_time(layouts, args)["hybrid"]))
        ratios = [h / t for h, t in zip(hybrid_runs, today_runs, strict=True)]
        print()
        print("| | allocate_slots + block tables |")
        print("|---|---:|")
        for name, xs in (("hybrid (7 groups)", hybrid_runs), ("before KV cache groups", today_runs)):
            print(f"| {name} | {statistics.median(xs) / 1e3:.0f} us [{min(xs) / 1e3:.0f}-{max(xs) / 1e3:.0f}] |")
        ratio = statistics.median(ratios)
        print(
            f"| hybrid / before | **{ratio:.2f}x** [{min(ratios):.2f}-{max(ratios):.2f}] (goal <= {HOST_GOAL}x): "
            f"{'met' if ratio <= HOST_GOAL else 'MISSED'} |"
        )
    print()
    print("goals:", "all met" if ok else "NOT all met")


if __name__ == "__main__":
    main()

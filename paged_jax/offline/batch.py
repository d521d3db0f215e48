"""Resumable batch generation: JSONL in, JSONL out, nothing lost.

Input lines: `{"id": ..., "prompt": "..."}`, `{"id": ..., "prompt_token_ids": [...]}` or
`{"id": ..., "messages": [{"role": "user", "content": "..."}, ...]}` (rendered with the model's chat
template; optional `add_generation_prompt`, `tools`, `chat_template_kwargs`), plus any `SamplingParams`
field (`max_tokens`, `temperature`, ...), an optional `cache_salt` and an optional `lora` (the name of an adapter
given with `--lora-modules name=path`; the line runs with it). Fields a line leaves unset take the
model's generation defaults (`generation_config.json`), then SamplingParams' own.
Each finished request is appended to the output as one line with a single `write` on an O_APPEND
descriptor, so `kill -9` loses at most the requests in flight and never leaves half a line (a torn
tail from a crash in the middle of a write is cut off on the next start). A re-run with the same
output skips ids already written; a run holds an exclusive lock on the output for its whole length, so
a second run on the same output is refused instead of duplicating lines. Ids keep their JSON type
(`1` and `"1"` are different requests). Any line that cannot be run (not UTF-8, not JSON, a bad field,
refused or failed by the engine) goes to the errors file with its line number, alone: the rest of
the job goes on, and a re-run retries it without repeating error lines already recorded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from paged_jax.engine.args import add_engine_args, build_engine, setup_logging
from paged_jax.engine.protocol import Engine
from paged_jax.lora.named import ServedAdapters, UnknownAdapterError, check_lora_modules, parse_lora_modules
from paged_jax.lora.request import LoRARequest
from paged_jax.offline import multihost
from paged_jax.offline.lines import BatchItem, LineError, parse_line
from paged_jax.offline.output_files import (
    BatchPathError,
    LineWriter,
    OutputLockedError,
    check_paths,
    completed_ids,
    default_errors_path,
    disk_full_message,
    result_line,
)
from paged_jax.offline.plan import plan_for_input

_SPEC_STATS = (
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_acceptance_rate",
    "spec_mean_accepted_length",
    "spec_acceptance_per_position",
)


@dataclass(slots=True)
class BatchSummary:
    requests: int = 0
    skipped: int = 0  # already in the output from an earlier run
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    preemptions: int = 0
    prefix_hit_rate: float = 0.0
    startup_seconds: float = 0.0  # model load, engine construction and warm-up, before the first request
    compile: dict = field(default_factory=dict)  # the engine's compile and padding counters (see EngineStats)
    spec: dict = field(default_factory=dict)  # speculative decoding's counters (EngineStats.spec_*), when on

    def lines(self) -> list[str]:
        tps = self.generated_tokens / self.seconds if self.seconds else 0.0
        p50, p99 = (np.percentile(self.ttfts, [50, 99]) * 1e3) if self.ttfts else (0.0, 0.0)
        return [
            f"requests           {self.requests} done, {self.skipped} skipped (already written), {self.errors} errors",
            f"tokens             {self.prompt_tokens} prompt ({self.cached_prompt_tokens} from prefix cache), "
            f"{self.generated_tokens} generated",
            f"throughput         {tps:.1f} generated tokens/s, {self.requests / max(self.seconds, 1e-9):.2f} req/s "
            f"over {self.seconds:.2f}s",
            f"time to first tok  p50 {p50:.1f} ms, p99 {p99:.1f} ms",
            f"prefix cache       hit rate {self.prefix_hit_rate:.1%}; preemptions {self.preemptions}",
            *self.spec_lines(),
            *self.startup_lines(),
        ]

    def spec_lines(self) -> list[str]:
        s = self.spec
        if not s or not s["spec_drafts"]:
            return []
        per = ", ".join(f"{rate:.0%}" for rate in s["spec_acceptance_per_position"])
        return [
            f"speculation        {s['spec_accepted_tokens']} of {s['spec_draft_tokens']} drafts kept "
            f"({s['spec_acceptance_rate']:.1%}), {s['spec_mean_accepted_length']:.2f} per verified sequence; "
            f"by position {per}"
        ]

    def startup_lines(self) -> list[str]:
        c = self.compile
        if not c:
            return []
        filler = c["step_padding_tokens"] / c["step_tokens"] if c["step_tokens"] else 0.0
        return [
            f"start-up           {self.startup_seconds:.1f}s: {c['executables_loaded']} executables loaded in "
            f"{c['executable_load_seconds']:.1f} s, {c['compile_count']} compiled in "
            f"{c['compile_seconds']:.1f} compile-s ({c['compile_lower_seconds']:.1f} lowering, "
            f"{c['compile_seconds'] - c['compile_lower_seconds']:.1f} XLA compile or cache lookup; "
            f"{c['compile_cache_hits']} from the persistent cache), {c['compiles_after_warmup']} after warm-up",
            f"step shapes        {filler:.2f} filler tokens per real token: steps run at a few compiled sizes, "
            f"so a step is padded to the next one ({c['step_padding_tokens']} filler, {c['step_tokens']} real)",
        ]


def read_items(
    path: Path,
    errors: LineWriter,
    summary: BatchSummary,
    skip: set[str],
    shard: tuple[int, int] = (0, 1),
    defaults: dict | None = None,
) -> Iterator[BatchItem]:
    """Valid items of this shard (`index, count`: every count-th line) not already done."""
    index, count = shard
    seen: set[str] = set()
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 fails alone, in parse_line
        for lineno, line in enumerate(f, 1):
            if (lineno - 1) % count != index or not line.strip():
                continue
            try:
                item = parse_line(line, lineno, defaults)
                if item.key in seen:
                    raise LineError("id", f"{item.id!r} appears twice in the input", item.id)
                seen.add(item.key)
            except (ValueError, RecursionError) as e:  # the line's id kept where it was read
                rid = e.id if isinstance(e, LineError) else None
                errors.write({"line": lineno, **({} if rid is None else {"id": rid}), "error": str(e)})
                summary.errors += 1
                continue
            if item.key in skip:
                summary.skipped += 1
                continue
            yield item


def _adapter(adapters: ServedAdapters | None, name: str) -> LoRARequest:
    if adapters is None:
        raise ValueError(f"lora: no LoRA adapters are served (--lora-modules), so {name!r} is unknown")
    try:
        return adapters.get(name)
    except UnknownAdapterError as e:
        raise ValueError(f"lora: {e} (--lora-modules)") from None


def run_batch(
    engine: Engine,
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    progress: bool = True,
    shard: tuple[int, int] = (0, 1),
    adapters: ServedAdapters | None = None,
) -> BatchSummary:
    """Generate for every line of `input_path` not yet in `output_path`; a line's `lora` names one of `adapters`."""
    errors_path = errors_path or default_errors_path(output_path)
    check_paths(input_path, output_path, errors_path)
    summary = BatchSummary()
    out = LineWriter(output_path)
    try:
        out.lock()  # before reading what is done: a second run must not resume from the same state
    except OutputLockedError:
        out.close()
        raise
    done = completed_ids(output_path)
    errors = LineWriter(errors_path, skip_written=True)
    ec = engine.engine_config
    window = 4 * ec.max_num_seqs * ec.data_parallel_size  # requests queued ahead of the engine(s)
    items = read_items(input_path, errors, summary, done, shard, ec.sampling_defaults)
    in_flight: dict[str, BatchItem] = {}  # engine request id -> item
    bar = tqdm(disable=not progress, desc="generate", unit="req")
    t0 = time.monotonic()
    exhausted = False
    try:
        while True:
            while not exhausted and len(in_flight) < window:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                try:
                    lora = None if item.lora is None else _adapter(adapters, item.lora)
                    engine.add_request(item.key, item.prompt, item.params, item.cache_salt, lora_request=lora)
                except Exception as e:  # noqa: BLE001 - this line fails alone (ValueError names the field)
                    errors.write({"line": item.lineno, "id": item.id, "error": str(e)})
                    summary.errors += 1
                    continue
                in_flight[item.key] = item
            if not in_flight:
                break
            for res in engine.step():
                if not res.finished:
                    continue
                item = in_flight.pop(res.request_id)
                if res.error is not None:  # failed inside the engine: not done, so a re-run retries it
                    errors.write({"line": item.lineno, "id": item.id, "error": f"engine: {res.error}"})
                    summary.errors += 1
                    continue
                out.write(result_line(res, item.id))
                summary.requests += 1
                summary.prompt_tokens += res.metrics.num_prompt_tokens
                summary.generated_tokens += res.metrics.num_generated_tokens
                summary.cached_prompt_tokens += res.metrics.num_cached_prompt_tokens
                if res.metrics.time_to_first_token is not None:
                    summary.ttfts.append(res.metrics.time_to_first_token)
                bar.update(1)
                elapsed = time.monotonic() - t0
                bar.set_postfix(
                    tok_s=f"{summary.generated_tokens / max(elapsed, 1e-9):.0f}",
                    kv=f"{engine.stats().slot_utilization:.0%}",
                    refresh=False,
                )
    finally:
        for rid in list(in_flight):
            engine.abort(rid)
        bar.close()
        out.close()
        errors.close()
    summary.seconds = time.monotonic() - t0
    stats = engine.stats()
    summary.preemptions = stats.num_preemptions
    summary.prefix_hit_rate = stats.prefix_hit_rate
    if engine.engine_config.speculative_config is not None:
        summary.spec = {k: getattr(stats, k) for k in _SPEC_STATS}
    summary.compile = {
        k: getattr(stats, k)
        for k in (
            "compile_count",
            "compile_seconds",
            "compile_lower_seconds",
            "compile_cache_hits",
            "compiles_after_warmup",
            "executables_loaded",
            "executable_load_seconds",
            "step_tokens",
            "step_padding_tokens",
        )
    }
    return summary


def add_args(parser) -> None:
    """Flags of `paged-jax generate`."""
    parser.add_argument("--input", required=True, type=Path, help="JSONL prompts")
    parser.add_argument("--output", required=True, type=Path, help="JSONL results (appended; re-runs resume)")
    parser.add_argument("--errors", type=Path, default=None, help="JSONL of rejected lines (default: beside output)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs and the summary stay)")
    g = parser.add_argument_group("multi-host (each process takes every count-th line; process 0 merges)")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() (on a TPU slice it finds the other hosts itself)",
    )
    g.add_argument("--coordinator-address", default=None, help="host:port of process 0 (implies --distributed)")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job (default: found by JAX)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index (default: found by JAX)")
    r = parser.add_argument_group("Ray (an actor pool of engines over a Ray Dataset; paged_jax.offline.ray_batch)")
    r.add_argument("--ray-actors", type=int, default=0, help="engine actors on the Ray cluster (0: no Ray)")
    r.add_argument("--ray-address", default=None, help="the Ray cluster (default: $RAY_ADDRESS, else a local one)")
    r.add_argument("--ray-tpus-per-actor", type=float, default=0, help="TPU chips each actor reserves (one per host)")
    r.add_argument("--ray-batch-size", type=int, default=64, help="rows Ray hands an actor at a time")
    add_engine_args(parser)


def run(args) -> int:
    setup_logging()
    if not args.input.exists():
        raise SystemExit(f"--input: {args.input} does not exist")
    try:  # before the model loads: a collision is a mistake in the command line
        check_paths(args.input, args.output, args.errors or default_errors_path(args.output))
    except BatchPathError as e:
        raise SystemExit(f"paged-jax generate: {e}") from None
    if args.ray_actors:
        return _run_on_ray(args)
    if args.distributed or args.coordinator_address:
        multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    count, index = jax.process_count(), jax.process_index()
    t0 = time.monotonic()
    engine = build_engine(args, warmup=False)
    try:  # every --lora-modules adapter read now, not on its first line
        modules = parse_lora_modules(args.lora_modules or ())
        check_lora_modules(modules, engine.config, engine.engine_config.max_lora_rank)
    except ValueError as e:
        raise SystemExit(f"paged-jax generate: {e}") from None
    if not args.no_warmup:  # only the shapes this input can reach
        written = args.output if count == 1 else multihost.part_path(args.output, index, count)
        engine.warmup(
            plan_for_input(engine, args.input, written, (index, count)), progress=not args.no_progress and index == 0
        )
    try:
        return _run(engine, args, count, index, time.monotonic() - t0)
    except OutputLockedError as e:
        raise SystemExit(f"paged-jax generate: {e}") from None
    except OSError as e:
        message = disk_full_message(e)
        if message is None:
            raise
        raise SystemExit(f"paged-jax generate: {message}") from None


def _run_on_ray(args) -> int:
    """`--ray-actors N`: the engines run in N actors of a Ray cluster (`paged_jax.offline.ray_batch`)."""
    import functools

    import ray

    from paged_jax.offline.ray_batch import run_on_ray

    if args.ray_actors < 0 or args.ray_batch_size < 1:
        raise SystemExit("paged-jax generate: --ray-actors must be >= 0 and --ray-batch-size >= 1")
    if args.distributed or args.coordinator_address:
        raise SystemExit("paged-jax generate: --ray-actors and --distributed: give one (Ray places the engines)")
    ray.init(address=args.ray_address)
    try:
        summary = run_on_ray(
            functools.partial(build_engine, args, warmup=False),
            args.input,
            args.output,
            args.errors,
            num_actors=args.ray_actors,
            batch_size=args.ray_batch_size,
            resources_per_actor={"TPU": args.ray_tpus_per_actor} if args.ray_tpus_per_actor else None,
            lora_modules=tuple(parse_lora_modules(args.lora_modules or ())),
        )
    except OutputLockedError as e:
        raise SystemExit(f"paged-jax generate: {e}") from None
    finally:
        ray.shutdown()
    print(
        f"\npaged-jax generate [ray, {args.ray_actors} actors]: {args.input} -> {args.output}\n"
        f"requests           {summary.requests} done, {summary.already_done} already written, {summary.errors} errors\n"
        f"tokens             {summary.generated_tokens} generated in {summary.seconds:.1f} s"
    )
    return 0


def _run(engine, args, count: int, index: int, startup: float) -> int:
    adapters = ServedAdapters(parse_lora_modules(args.lora_modules)) if args.lora_modules else None
    if count == 1:
        summary = run_batch(
            engine, args.input, args.output, args.errors, progress=not args.no_progress, adapters=adapters
        )
        summary.startup_seconds = startup
        print("\n".join(["", f"paged-jax generate: {args.input} -> {args.output}", *summary.lines()]))
        return 0
    errors = args.errors or default_errors_path(args.output)
    out_part, err_part = (multihost.part_path(p, index, count) for p in (args.output, errors))
    summary = run_batch(
        engine,
        args.input,
        out_part,
        err_part,
        progress=not args.no_progress and index == 0,
        shard=(index, count),
        adapters=adapters,
    )
    summary.startup_seconds = startup
    print(
        "\n".join(["", f"paged-jax generate [process {index}/{count}]: {args.input} -> {out_part}", *summary.lines()])
    )
    added = multihost.merge_parts(args.output, errors, count)
    if added is not None:
        print(f"merged {count} parts into {args.output} ({added} new lines)")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m paged_jax.offline.batch", description=__doc__)
    add_args(ap)
    raise SystemExit(run(ap.parse_args()))

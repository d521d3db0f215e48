"""Batch generation on Ray Data: the batch job's engine as an actor-pool stage over a Ray Dataset.

Each actor of the pool builds one engine (`engine_factory`, called once in the actor: one per host, or per slice
when the factory builds a multi-chip engine) and generates for the batches of input rows Ray hands it, exactly as
the JSONL job does for its lines (`paged_jax.offline.lines.parse_line`: the same fields, defaults and errors). The
driver appends each finished row to the output as it arrives (`LineWriter`: one `write` per line, an exclusive
lock on the output), so the job is resumable like the JSONL job: a re-run skips the ids already written and a
crash loses only the batches in flight. Rows whose line cannot run go to the errors file, alone.

Input: a JSONL file (every line is a row; its line number names a line without an `id`) or a Parquet file or
directory (one row per line's fields; a row needs an `id`, since Parquet rows have no line numbers). Ray is
imported only here, and this module only by `paged-jax generate --ray-actors` and its callers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paged_jax.engine.protocol import Engine
from paged_jax.lora.named import ServedAdapters, UnknownAdapterError
from paged_jax.offline.lines import BatchItem, LineError, parse_line
from paged_jax.offline.output_files import (
    LineWriter,
    OutputLockedError,
    check_paths,
    completed_ids,
    default_errors_path,
    result_line,
)

EngineFactory = Callable[[], Engine]
"""Builds one engine inside an actor (a picklable callable: a module-level function or a `functools.partial`)."""


@dataclass(frozen=True, slots=True)
class RayBatchSummary:
    requests: int
    already_done: int  # ids in the output from an earlier run (skipped)
    errors: int
    generated_tokens: int
    seconds: float


class EngineStage:
    """The Ray Data callable class: one engine per actor; each call generates for one batch of rows.

    A batch is ``{"lineno": int64 [B], "line": object [B]}``; the reply ``{"key", "result", "error"}`` (object
    [R]): per row not skipped, its id's key and either its result line or its error line as JSON text."""

    def __init__(self, engine_factory: EngineFactory, skip: frozenset[str], lora_modules: tuple = ()) -> None:
        self.engine = engine_factory()
        self.skip = skip
        self.adapters = ServedAdapters(list(lora_modules)) if lora_modules else None
        self.batches = 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        engine = self.engine
        keys: list[str] = []
        results: list[str] = []
        errors: list[str] = []

        def fail(lineno: int, rid: Any, message: str, key: str) -> None:
            line = {"line": int(lineno) or None, **({} if rid is None else {"id": rid}), "error": message}
            keys.append(key)
            results.append("")
            errors.append(json.dumps(line))

        in_flight: dict[str, BatchItem] = {}
        for lineno, text in zip(batch["lineno"], batch["line"], strict=True):
            try:
                item = parse_line(str(text), int(lineno), engine.engine_config.sampling_defaults)
                if not lineno and item.id == f"line-{int(lineno)}":
                    raise ValueError("id: required for a Parquet row (rows have no line numbers)")
            except (ValueError, RecursionError) as e:
                rid = e.id if isinstance(e, LineError) else None
                fail(int(lineno), rid, str(e), "" if rid is None else json.dumps(rid))
                continue
            if item.key in self.skip:
                continue
            if item.key in in_flight:
                fail(item.lineno, item.id, f"id: {item.id!r} appears twice in the input", item.key)
                continue
            try:
                lora = None if item.lora is None else self._adapter(item.lora)
                engine.add_request(item.key, item.prompt, item.params, item.cache_salt, lora_request=lora)
            except Exception as e:  # noqa: BLE001 - this row fails alone (ValueError names the field)
                fail(item.lineno, item.id, str(e), item.key)
                continue
            in_flight[item.key] = item
        while in_flight:
            for res in engine.step():
                if not res.finished:
                    continue
                item = in_flight.pop(res.request_id)
                if res.error is not None:
                    fail(item.lineno, item.id, f"engine: {res.error}", item.key)
                    continue
                keys.append(item.key)
                results.append(json.dumps(result_line(res, item.id)))
                errors.append("")
        self.batches += 1
        return {"key": keys, "result": results, "error": errors}

    def _adapter(self, name: str):
        if self.adapters is None:
            raise ValueError(f"lora: no LoRA adapters are served (--lora-modules), so {name!r} is unknown")
        try:
            return self.adapters.get(name)
        except UnknownAdapterError as e:
            raise ValueError(f"lora: {e} (--lora-modules)") from None


def read_dataset(input_path: Path):
    """The input as a Ray Dataset of ``{"lineno", "line"}`` rows (module docstring)."""
    import ray.data

    if input_path.suffix == ".jsonl" or input_path.suffix == ".json":
        with open(input_path, "rb") as f:
            rows = [{"lineno": n, "line": raw.decode("utf-8", "replace")} for n, raw in enumerate(f, 1) if raw.strip()]
        return ray.data.from_items(rows)
    table = ray.data.read_parquet(str(input_path))

    def as_lines(batch: dict[str, np.ndarray]) -> dict[str, list]:
        columns = list(batch)
        size = len(batch[columns[0]]) if columns else 0
        lines = []
        for i in range(size):
            row = {c: _plain(batch[c][i]) for c in columns}
            lines.append(json.dumps({k: v for k, v in row.items() if v is not None}))
        return {"lineno": [0] * size, "line": lines}

    return table.map_batches(as_lines, batch_format="numpy")


def _plain(value: Any) -> Any:
    """A Parquet cell as JSON's types (numpy scalars and arrays, nested)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def run_on_ray(
    engine_factory: EngineFactory,
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    num_actors: int = 2,
    batch_size: int = 64,
    num_cpus_per_actor: float = 1.0,
    resources_per_actor: dict[str, float] | None = None,
    lora_modules: Iterable[tuple[str, str]] = (),
) -> RayBatchSummary:
    """Generate for every row of `input_path` not yet in `output_path` on `num_actors` engine actors of the
    running Ray cluster (`ray.init()` first; a local one if none). `resources_per_actor`: e.g. ``{"TPU": 4}`` for
    one actor per TPU VM host."""
    errors_path = errors_path or default_errors_path(output_path)
    check_paths(input_path, output_path, errors_path)
    out = LineWriter(output_path)
    try:
        out.lock()
    except OutputLockedError:
        out.close()
        raise
    done = completed_ids(output_path)
    errors = LineWriter(errors_path, skip_written=True)
    t0 = time.monotonic()
    requests = skipped_errors = generated = 0
    seen: set[str] = set()
    try:
        stage = read_dataset(input_path).map_batches(
            EngineStage,
            fn_constructor_args=(engine_factory, frozenset(done), tuple(lora_modules)),
            batch_size=batch_size,
            batch_format="numpy",
            concurrency=num_actors,
            num_cpus=num_cpus_per_actor,
            resources=resources_per_actor,
        )
        for batch in stage.iter_batches(batch_size=None, batch_format="numpy"):
            for key, result, error in zip(batch["key"], batch["result"], batch["error"], strict=True):
                key, result, error = str(key), str(result), str(error)
                if error:
                    errors.write(json.loads(error))
                    skipped_errors += 1
                    continue
                if key in seen:  # two actors ran the same id: the input has it twice
                    line = json.loads(result)
                    errors.write({"id": line["id"], "error": f"id: {line['id']!r} appears twice in the input"})
                    skipped_errors += 1
                    continue
                seen.add(key)
                line = json.loads(result)
                out.write(line)
                requests += 1
                generated += line["usage"]["completion_tokens"]
    finally:
        out.close()
        errors.close()
    return RayBatchSummary(requests, len(done), skipped_errors, generated, time.monotonic() - t0)


__all__ = ["EngineStage", "RayBatchSummary", "read_dataset", "run_on_ray"]

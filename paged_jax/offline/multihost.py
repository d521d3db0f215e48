"""Multi-host: every host runs the same program after `jax.distributed.initialize()`.

Decision: each host (process) runs its own engine replica(s) over its *local* devices, with its own
scheduler and KV manager; no step metadata crosses hosts. The alternative, one scheduler on process 0
broadcasting each step's metadata to every host so one TP group can span hosts, was rejected because:

- The step is latency-bound at decode: a broadcast per step puts a host-to-host round trip (DCN, not
  ICI) and a lock-step barrier across all hosts on the critical path of every token, and the slowest
  host's Python sets the pace for all.
- The models we serve fit one host: Llama-3.1-8B in bfloat16 needs 16 GB of weights, a v5e host has 4
  or 8 chips x 16 GiB, so TP 4 or 8 inside a host (over ICI) plus one replica per host is the natural
  layout. TP across hosts only pays for models that do not fit one host's chips (e.g. 405B).
- Independence: a host that is slow or fails takes down its own replica, not a lock-stepped slice; the
  batch shards are resumable per host.
The cost: a model that needs more chips than one host has cannot be served this way (it would need the
broadcast design, with the engine's `launch_step` inputs sent from process 0 via
`multihost_utils.broadcast_one_to_all`); and requests are split statically (every count-th input line)
rather than by load.

The batch script on a slice: every process reads the input, takes lines `index, index + count, ...`
(`jax.process_index()`, `jax.process_count()`), and writes its own part file (resumable like the single
output). At the end every process sends its part's bytes through `process_allgather` (so no shared
filesystem is needed), and process 0 appends to the one output every line whose id is not there yet:
no duplicates, no losses, and a re-run after a crash (of any host, at any point) completes the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

CHUNK_BYTES = 4 * 2**20  # bytes per all-gather round when collecting part files


def initialize(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """`jax.distributed.initialize`, with gloo CPU collectives so the same code runs on a CPU cluster.

    On a TPU slice pass nothing (the TPU environment names the coordinator and this process). Must run
    before anything touches a JAX backend.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def part_path(path: Path, index: int, count: int) -> Path:
    """`out.jsonl` -> `out.part-00001-of-00002.jsonl` (this process's share of `path`)."""
    return path.with_name(f"{path.stem}.part-{index:05d}-of-{count:05d}{path.suffix}")


def allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data`, in process order, on every process (a collective: all must call it)."""
    sizes = multihost_utils.process_allgather(np.array([len(data)], np.int64))  # [P, 1]
    sizes = [int(n) for n in np.asarray(sizes).reshape(-1)]
    chunk = max(1, min(CHUNK_BYTES, max(sizes)))
    parts: list[list[bytes]] = [[] for _ in sizes]
    buf = np.frombuffer(data, np.uint8)
    for start in range(0, max(sizes), chunk):
        local = np.zeros(chunk, np.uint8)
        piece = buf[start : start + chunk]
        local[: len(piece)] = piece
        gathered = np.asarray(multihost_utils.process_allgather(local))  # [P, chunk]
        for p, n in enumerate(sizes):
            parts[p].append(gathered[p, : max(0, min(chunk, n - start))].tobytes())
    return [b"".join(p) for p in parts]


def _whole_lines(data: bytes) -> list[bytes]:
    """The complete, non-blank lines of `data`: a torn tail (no newline, from a crash mid-write) is left out."""
    return [line for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def _append_new(path: Path, blobs: list[bytes], key) -> int:
    """Append the lines of `blobs` whose key is not in `path` yet (nor earlier in `blobs`); count them.

    A torn tail of `path` (process 0 killed during an earlier merge) is cut off first; torn tails of the
    blobs are skipped (their lines are not done, and the host's next run redoes them).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        f.seek(0)
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
        seen = {key(line) for line in _whole_lines(data)}
        new = []
        for blob in blobs:
            for line in _whole_lines(blob):
                if key(line) not in seen:
                    seen.add(key(line))
                    new.append(line + b"\n")
        f.write(b"".join(new))
    return len(new)


def merge_parts(output: Path, errors: Path, count: int) -> int | None:
    """Collect every process's part files into `output` and `errors` on process 0 (a collective).

    Result lines are deduplicated by id, error lines by their whole text. Returns the number of result
    lines added on process 0, None elsewhere. The part files stay: they are each host's resume state.
    """
    index = jax.process_index()
    mine = [part_path(p, index, count) for p in (output, errors)]
    blobs = [allgather_bytes(p.read_bytes() if p.exists() else b"") for p in mine]
    if index != 0:
        return None
    added = _append_new(output, blobs[0], key=lambda line: json.dumps(json.loads(line)["id"]))
    _append_new(errors, blobs[1], key=lambda line: line)
    return added


__all__ = ["allgather_bytes", "initialize", "merge_parts", "part_path"]

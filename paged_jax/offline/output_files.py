"""The batch job's output files: whole lines appended with one write each, an exclusive lock per run, the ids
already written (a torn last line cut off first), and the result line of one finished request."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from paged_jax.offline.lines import id_key
from paged_jax.outputs import CompletionOutput, RequestOutput


class OutputLockedError(RuntimeError):
    """Another run holds the output file."""


def written_ids(path: Path) -> set[str]:
    """Ids of the whole lines already in the output (a torn last line is none); reads only, so it is safe
    without the output's lock (the warm-up plan, read before the run takes it)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    return _ids(data[: data.rfind(b"\n") + 1])


def completed_ids(path: Path) -> set[str]:
    """Ids already in the output; a torn last line (no newline) is cut off first. Call it holding the
    output's lock (`LineWriter.lock`): the torn line may be another run's write in progress."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    return _ids(data)


def _ids(data: bytes) -> set[str]:
    return {id_key(json.loads(raw)["id"]) for raw in data.splitlines() if raw.strip()}


class LineWriter:
    """Appends whole lines with one `os.write` each on an O_APPEND descriptor.

    `skip_written`: lines already in the file are not written again (the errors file across re-runs).
    """

    def __init__(self, path: Path, skip_written: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._written: set[bytes] | None = None
        if skip_written:
            self._written = {line + b"\n" for line in path.read_bytes().splitlines()}

    def lock(self) -> None:
        """Hold an exclusive lock on the file until `close` (or the process ends, even by `kill -9`)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLockedError(
                f"--output: {self.path} is being written by another run; wait for it to finish or choose another output"
            ) from None

    def write(self, obj: dict) -> None:
        try:
            data = (json.dumps(obj, ensure_ascii=False) + "\n").encode()
        except UnicodeEncodeError:  # never fail on a line: escape what UTF-8 cannot hold
            data = (json.dumps(obj) + "\n").encode()
        if self._written is not None:
            if data in self._written:
                return
            self._written.add(data)
        written = os.write(self.fd, data)
        if written != len(data):  # a regular file takes the whole line, but never leave a torn one
            os.ftruncate(self.fd, os.lseek(self.fd, 0, os.SEEK_END) - written)
            raise OSError(f"short write ({written} of {len(data)} bytes)")

    def close(self) -> None:
        os.close(self.fd)


def _logprobs(c: CompletionOutput) -> list[dict]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs]


def result_line(out: RequestOutput, rid: str | int) -> dict:
    first = out.outputs[0]
    line = {
        "id": rid,
        "text": first.text,
        "token_ids": first.token_ids,
        "finish_reason": first.finish_reason,
        "usage": {
            "prompt_tokens": out.metrics.num_prompt_tokens,
            "completion_tokens": out.metrics.num_generated_tokens,
            "cached_prompt_tokens": out.metrics.num_cached_prompt_tokens,
        },
        "time_to_first_token_s": out.metrics.time_to_first_token,
    }
    if len(out.outputs) > 1:
        line["choices"] = [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            for c in out.outputs
        ]
        if first.logprobs is not None:
            for choice, c in zip(line["choices"], out.outputs, strict=True):
                choice["logprobs"] = _logprobs(c)
    if first.logprobs is not None:
        line["logprobs"] = _logprobs(first)
    return line

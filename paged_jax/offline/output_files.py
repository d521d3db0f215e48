"""The batch job's output files: whole lines appended with one write each, an exclusive lock per run, the ids
already written (a torn last line cut off first, a line that is not a result skipped with a warning), distinct
input, output and errors files, and the result line of one finished request."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from paged_jax.offline.lines import id_key
from paged_jax.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over the file size limit


class OutputLockedError(RuntimeError):
    """Another run holds the output file."""


class BatchPathError(ValueError):
    """The batch job's files collide or are not regular files; the message names the flag."""


def default_errors_path(output_path: Path) -> Path:
    """Where the rejected lines of `output_path`'s job go unless told: `out.errors.jsonl` beside `out.jsonl`."""
    return output_path.with_name(output_path.stem + ".errors.jsonl")


def check_paths(
    input_path: Path,
    output_path: Path,
    errors_path: Path | None = None,
    flags: tuple[str, str, str] = ("--input", "--output", "--errors"),
) -> None:
    """Refuse an input, output and errors file that are one file (by resolved path or by inode), and an
    output or errors path that is not a regular file: results mixed with error lines broke every re-run.
    `errors_path` None: a job without an errors file; `flags`: the three files' flags, for the message."""
    named = {flags[0]: input_path, flags[1]: output_path}
    if errors_path is not None:
        named[flags[2]] = errors_path
    for flag, path in list(named.items())[1:]:  # read back, then appended to
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            raise BatchPathError(f"{flag}: {path} is not a regular file")
    names = list(named)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pa, pb = named[a], named[b]
            same = pa.resolve() == pb.resolve() or (pa.exists() and pb.exists() and os.path.samefile(pa, pb))
            if same:
                raise BatchPathError(f"{b}: {pb} is the same file as {a}; give them different paths")


def disk_full_message(e: OSError) -> str | None:
    """One line for a write that failed for lack of space (None for any other error)."""
    if e.errno not in DISK_FULL:
        return None
    where = f"{e.filename}: " if e.filename else ""
    return (
        f"{where}{os.strerror(e.errno).lower()}; every line written so far is whole, so after freeing space "
        "a re-run resumes where this one stopped"
    )


def written_ids(path: Path) -> set[str]:
    """Ids of the whole lines already in the output (a torn last line is none); reads only, so it is safe
    without the output's lock (the warm-up plan, read before the run takes it)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    return _ids(data[: data.rfind(b"\n") + 1], path)


def completed_ids(path: Path) -> set[str]:
    """Ids already in the output; a torn last line (no newline) is cut off first, and a line that is not a
    result (not JSON, no `id`, an error line) is skipped with a warning (not done: it is generated again).
    Call it holding the output's lock (`LineWriter.lock`): the torn line may be another run's write in progress."""
    return _ids(whole_lines(path), path)


def whole_lines(path: Path) -> bytes:
    """The output's whole lines, a torn last line (no newline: a write that `kill -9` cut short) cut off the
    file first. Call it holding the output's lock (`LineWriter.lock`)."""
    if not path.exists():
        return b""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        data = data[:keep]
    return data


def _ids(data: bytes, path: Path) -> set[str]:
    done, skipped = set(), []
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or "error" in obj:  # an error line ({"line", "id", "error"}) is not done
                raise ValueError
            done.add(id_key(obj["id"]))
        except (ValueError, TypeError, KeyError):  # not JSON, not a result, no id, an id of no known type
            skipped.append(lineno)
    if skipped:
        log.warning(
            "%s: %d line(s) are not result lines and were skipped (first: line %d)", path, len(skipped), skipped[0]
        )
    return done


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
        try:
            written = os.write(self.fd, data)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        if written != len(data):  # a regular file takes the whole line, but never leave a torn one
            os.ftruncate(self.fd, os.lseek(self.fd, 0, os.SEEK_END) - written)
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)", str(self.path))

    def close(self) -> None:
        os.close(self.fd)


def _logprobs(c: CompletionOutput) -> list[dict]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs or ()]


def result_line(out: RequestOutput, rid: str | int) -> dict:
    first = out.outputs[0]
    line: dict[str, Any] = {
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
    if out.prompt_logprobs is not None:  # one per prompt token, null for the first
        line["prompt_logprobs"] = [
            None if lp is None else {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
            for lp in out.prompt_logprobs
        ]
    return line

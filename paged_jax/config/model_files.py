"""Which files of a model directory may be read, and how much of them: regular files inside it, JSON capped.

A model directory is input from whoever supplied it. Its `config.json` could be a link to `/dev/zero`
(read until out of memory), its `tokenizer.json` a FIFO (open blocks forever), its `model.safetensors` a
link to a file anywhere on the machine. So every file a loader reads from a directory goes through
`model_file`: it must be a regular file whose resolved path lies inside that directory, or inside the
Hugging Face hub cache's `blobs/` folder of the same repository when the directory is one of its
`snapshots/<revision>/` folders (the hub links every snapshot file there). Files are opened non-blocking
and checked again on the open descriptor (`fstat`), so a file swapped for a FIFO after the check cannot
block, and read with a size cap.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 128 * 2**20  # far above any tokenizer.json (the largest vocabularies are tens of MiB)
MAX_TEXT_BYTES = 16 * 2**20  # chat templates


class ModelFileError(ValueError):
    """A model file that is not a readable regular file inside its directory; the message names the file."""


def _allowed_roots(directory: Path) -> list[Path]:
    root = directory.resolve()
    roots = [root]
    if root.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<rev>/ links into ../../blobs/
        roots.append(root.parent.parent / "blobs")
    return roots


def model_file(directory: str | Path, name: str) -> Path | None:
    """`directory/name` resolved, or None when nothing is there. Raises `ModelFileError` naming the file
    when it is a link out of the directory, a broken link, or not a regular file (FIFO, device, folder)."""
    directory = Path(directory)
    path = directory / name
    if not os.path.lexists(path):
        return None
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(directory)):
        raise ModelFileError(f"{name}: links to {resolved}, outside the model directory {directory}")
    try:
        mode = os.stat(resolved).st_mode
    except OSError as e:
        raise ModelFileError(f"{name}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ModelFileError(f"{name}: not a regular file")
    return resolved


def checked_path(path: str | Path) -> Path | None:
    """`model_file` of a path's own directory and name (a file named by itself, e.g. `--model x.json`)."""
    path = Path(path)
    return model_file(path.parent, path.name)


def read_bytes(path: str | Path, limit: int) -> bytes:
    """The file's bytes, at most `limit` of them (more is an error), never blocking on a special file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ModelFileError(f"{path.name}: cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ModelFileError(f"{path.name}: not a regular file")
        chunks = [f.read(min(info.st_size, limit) + 1)]  # sized by the file, not the cap (read() allocates n)
        while chunks[-1] and sum(map(len, chunks)) <= limit:  # the file grew since fstat
            chunks.append(f.read(2**20))
        data = b"".join(chunks)
    if len(data) > limit:
        raise ModelFileError(f"{path.name}: larger than the {limit // 2**20} MiB read limit")
    return data


def read_text(path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """The file as UTF-8 text (see `read_bytes`)."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{Path(path).name}: not UTF-8 text ({e})") from None


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> Any:
    """The file's JSON value (see `read_bytes`); malformed or absurdly nested JSON is a `ModelFileError`."""
    text = read_text(path, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{Path(path).name}: not valid JSON ({e})") from None
    except RecursionError:
        raise ModelFileError(f"{Path(path).name}: JSON nested too deeply") from None


def read_json_object(directory: str | Path, name: str) -> dict[str, Any]:
    """`directory/name` as a JSON object, or {} when the file does not exist."""
    path = model_file(directory, name)
    if path is None:
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise ModelFileError(f"{name}: expected a JSON object")
    return data


__all__ = [
    "MAX_JSON_BYTES",
    "MAX_TEXT_BYTES",
    "ModelFileError",
    "checked_path",
    "model_file",
    "read_bytes",
    "read_json",
    "read_json_object",
    "read_text",
]

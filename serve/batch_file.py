"""`paged-jax run-batch -i requests.jsonl -o results.jsonl`: the OpenAI Batch API's file format, run offline.

Input lines (OpenAI's): `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/embeddings" | "/v1/responses", "body": {...}}`. Output lines (OpenAI's):
`{"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}`, one
per input line, in the order requests finish. Each body is answered by the HTTP front itself: the OpenAI app
(`serve.openai_api.app`) is called in process over ASGI with the line's body, on an engine loop of its own, so a
line gets exactly the response (and the 4xx error body) `POST <url>` would get from `paged-jax serve` with the
same flags, through the same parsing and validation. A line that is not a request (not JSON, no string
`custom_id`, a method other than POST, another url, a body that is not an object or asks to stream, a
`custom_id` seen before) gets `response: null` and `error: {"code", "message"}` naming the field; it stops
nothing else.

Resumable and `kill -9` safe like `paged-jax generate` (`paged_jax.offline.output_files`): each line is appended
with one write on an O_APPEND descriptor, a run holds an exclusive lock on the output, a torn last line is cut off
on the next start, and a re-run skips every `custom_id` already written (and every unreadable line already
reported, by its line number): delete a line to run its request again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from paged_jax.bounded_json import load_json
from paged_jax.engine.args import MODEL_HELP, add_engine_args, build_engine, setup_logging
from paged_jax.engine.protocol import Engine
from paged_jax.errors import FieldError, UsageError
from paged_jax.offline.output_files import (
    BatchPathError,
    LineWriter,
    OutputLockedError,
    check_paths,
    disk_full_message,
    whole_lines,
)

from .config import ServingConfig
from .engine_loop import EngineLoop
from .metrics import Metrics
from .openai_api.app import create_app
from .openai_api.front import OpenAIFront

log = logging.getLogger(__name__)
URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
LINE_ID = "batch_req_line_"  # the id of an unreadable line's error line: `LINE_ID` + its line number
FLAGS = ("--input-file", "--output-file", "")


@dataclass(slots=True)
class BatchLine:
    """One input line that is a request."""

    lineno: int
    custom_id: str
    url: str
    body: bytes  # the request body as JSON, as the HTTP front reads it


@dataclass(slots=True)
class BatchFileSummary:
    requests: int = 0  # answered with a response (any status)
    ok: int = 0  # of them, status 200
    invalid_lines: int = 0  # lines that are not requests
    skipped: int = 0  # already in the output from an earlier run

    def line(self) -> str:
        return (
            f"{self.requests} requests answered ({self.ok} ok, {self.requests - self.ok} with an error status), "
            f"{self.invalid_lines} invalid lines, {self.skipped} skipped (already written)"
        )


class LineRefused(ValueError):
    """A line that is not a request: the field at fault, and the line's custom_id once it was read."""

    def __init__(self, field: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.custom_id = custom_id


def parse_line(raw: bytes, lineno: int) -> BatchLine:
    """One input line as a request; LineRefused naming the field (the body itself is the front's to check)."""
    try:
        obj = load_json(raw, "line")
    except FieldError as e:
        raise LineRefused(e.field, e.message) from None
    if not isinstance(obj, dict):
        raise LineRefused("line", "must be a JSON object with custom_id, method, url and body")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineRefused("custom_id", "must be a non-empty string")
    if obj.get("method") != "POST":
        raise LineRefused("method", f"must be POST, got {obj.get('method')!r}", cid)
    url = obj.get("url")
    if url not in URLS:
        raise LineRefused("url", f"must be one of {', '.join(URLS)}, got {url!r}", cid)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineRefused("body", "must be a JSON object (the request's body)", cid)
    if body.get("stream"):
        raise LineRefused("body.stream", "a batch request cannot stream (its response is one line)", cid)
    return BatchLine(lineno, cid, url, json.dumps(body).encode())


def done_keys(output: Path) -> tuple[set[str], set[int]]:
    """(custom_ids already answered, line numbers of unreadable lines already reported) in `output`; call it
    holding the output's lock."""
    cids: set[str] = set()
    lines: set[int] = set()
    for raw in whole_lines(output).splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("custom_id"), str):
            cids.add(obj["custom_id"])
        rid = obj.get("id")
        if isinstance(rid, str) and rid.startswith(LINE_ID) and rid[len(LINE_ID) :].isdigit():
            lines.add(int(rid[len(LINE_ID) :]))
    return cids, lines


def error_line(lineno: int, e: LineRefused) -> dict[str, Any]:
    return {
        "id": f"{LINE_ID}{lineno}",
        "custom_id": e.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": f"line {lineno}: {e}"},
    }


def response_line(line: BatchLine, status: int, body: bytes) -> dict[str, Any]:
    """The output line of a request the front answered with `status` and the JSON `body`."""
    obj = json.loads(body)
    rid = obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), str) else f"req_{uuid.uuid4().hex}"
    response = {"status_code": status, "request_id": rid, "body": obj}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response, "error": None}


async def post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` (JSON) to `path` of the ASGI `app` in process: (status, response body). The client "stays
    connected" until the response is complete, as an HTTP client waiting for it would."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    complete = asyncio.Event()
    sent = False
    status, parts = 500, []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                complete.set()

    try:
        await app(scope, receive, send)
    finally:
        complete.set()
    return status, b"".join(parts)


def read_lines(
    path: Path,
    out: LineWriter,
    summary: BatchFileSummary,
    done: tuple[set[str], set[int]],
    passed: Callable[[], Any] = lambda: None,
) -> Iterator[BatchLine]:
    """The input's requests not yet answered; an unreadable line (not yet reported) gets its error line now.
    `passed` is called for each line not yielded (the progress bar)."""
    cids, reported = done
    seen: set[str] = set()
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 fails alone
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = parse_line(raw, lineno)
                if line.custom_id in seen:  # its error line names it in the message only: the first one runs
                    raise LineRefused("custom_id", f"{line.custom_id!r} appears twice in the input")
                seen.add(line.custom_id)
            except (LineRefused, RecursionError) as e:
                if lineno not in reported:
                    refused = e if isinstance(e, LineRefused) else LineRefused("line", "nested too deeply")
                    out.write(error_line(lineno, refused))
                    summary.invalid_lines += 1
                else:
                    summary.skipped += 1
                passed()
                continue
            if line.custom_id in cids:
                summary.skipped += 1
                passed()
                continue
            yield line


async def run_file(
    engine: Engine,
    input_path: Path,
    output_path: Path,
    config: ServingConfig | None = None,
    progress: bool = True,
) -> BatchFileSummary:
    """Answer every request of `input_path` not yet in `output_path` through the OpenAI app over `engine` (its own
    engine loop, started and stopped here), at most `window` in flight."""
    check_paths(input_path, output_path, flags=FLAGS)
    config = config or ServingConfig()
    out = LineWriter(output_path)
    try:
        out.lock()  # before reading what is done: a second run must not resume from the same state
    except OutputLockedError:
        out.close()
        raise
    summary = BatchFileSummary()
    loop = EngineLoop(engine).start()
    app = create_app(OpenAIFront(loop, config, Metrics()))
    ec = engine.engine_config
    window = max(1, min(4 * ec.max_num_seqs * ec.data_parallel_size, config.max_queued_requests))
    total = sum(1 for raw in input_path.open("rb") if raw.strip())
    bar = tqdm(total=total, disable=not progress, desc="run-batch", unit="req")
    pending: set[asyncio.Task] = set()

    async def one(line: BatchLine) -> None:
        status, body = await post(app, line.url, line.body)
        out.write(response_line(line, status, body))
        summary.requests += 1
        summary.ok += status == 200
        bar.update(1)

    try:
        for line in read_lines(input_path, out, summary, done_keys(output_path), lambda: bar.update(1)):
            while len(pending) >= window:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending -= finished
                for task in finished:
                    task.result()  # a write that failed (disk full) ends the run
            pending.add(asyncio.ensure_future(one(line)))
        if pending:
            await asyncio.gather(*pending)
        pending.clear()
    finally:
        for task in pending:
            task.cancel()
        bar.close()
        loop.stop()
        out.close()
    return summary


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `paged-jax run-batch` (vLLM's names)."""
    parser.add_argument("-i", "--input-file", required=True, type=Path, help="the OpenAI batch file (JSONL)")
    parser.add_argument(
        "-o", "--output-file", required=True, type=Path, help="results, OpenAI's output format (appended; resumes)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME", help="the names bodies may give in `model`"
    )
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    """Check the files, load the model (`--model`), answer every line, print a summary."""
    if args.model is None:
        raise UsageError(f"--model is required: {MODEL_HELP}")
    if not args.input_file.exists():
        raise UsageError(f"--input-file: {args.input_file} does not exist")
    try:
        check_paths(args.input_file, args.output_file, flags=FLAGS)
    except BatchPathError as e:
        raise UsageError(str(e)) from None
    setup_logging()
    engine = build_engine(args)
    names = tuple(args.served_model_name or ())
    config = ServingConfig(served_model_names=names)
    try:
        summary = asyncio.run(run_file(engine, args.input_file, args.output_file, config, not args.no_progress))
    except OutputLockedError as e:
        raise UsageError(str(e).replace("--output:", "--output-file:")) from None
    except OSError as e:
        message = disk_full_message(e)
        if message is None:
            raise
        raise SystemExit(f"paged-jax run-batch: {message}") from None
    print(f"paged-jax run-batch: {args.input_file} -> {args.output_file}: {summary.line()}")
    return 0

"""Batch misuse: colliding paths are refused up front, stray lines in the output are skipped with a warning,
and a full disk is one clean line (the file stays whole, a re-run resumes).

Before: `--errors` equal to `--output` mixed error lines into the results and every later run crashed at
start-up with `KeyError: 'id'` (as did any non-result line); `--input` equal to `--output` exited 0 having
done nothing; a full disk ended in a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_jax.offline.batch import run_batch
from paged_jax.offline.output_files import BatchPathError

from support.engines import make_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine(tiny_config, tiny_params):
    return make_engine(tiny_config, tiny_params, num_pages=64, max_num_seqs=4, max_num_batched_tokens=32)


def _input(path: Path, n: int) -> Path:
    lines = [json.dumps({"id": f"q{i}", "prompt": f"prompt {i}", "max_tokens": 4, "temperature": 0}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if "token_ids" in line]


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink", "dotted"])
def test_errors_file_equal_to_output_is_refused(engine, tmp_path: Path, alias: str) -> None:
    inp, out = _input(tmp_path / "in.jsonl", 2), tmp_path / "out.jsonl"
    out.write_text("")
    errors = {
        "same": out,
        "symlink": tmp_path / "link.jsonl",
        "hardlink": tmp_path / "hard.jsonl",
        "dotted": tmp_path / "." / "sub" / ".." / "out.jsonl",
    }[alias]
    (tmp_path / "sub").mkdir()
    if alias == "symlink":
        errors.symlink_to(out)
    elif alias == "hardlink":
        os.link(out, errors)
    with pytest.raises(BatchPathError, match="^--errors: .* is the same file as --output"):
        run_batch(engine, inp, out, errors, progress=False)
    assert out.read_text() == ""


def test_input_equal_to_output_is_refused(engine, tmp_path: Path) -> None:
    inp = _input(tmp_path / "in.jsonl", 2)
    with pytest.raises(BatchPathError, match="^--output: .* is the same file as --input"):
        run_batch(engine, inp, inp, progress=False)


def test_output_must_be_a_regular_file(engine, tmp_path: Path) -> None:
    inp = _input(tmp_path / "in.jsonl", 1)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(BatchPathError, match="^--output: .* is not a regular file"):
        run_batch(engine, inp, tmp_path / "fifo", progress=False)


def test_stray_lines_in_the_output_are_skipped_with_a_warning(engine, tmp_path: Path, caplog) -> None:
    inp, out = _input(tmp_path / "in.jsonl", 4), tmp_path / "out.jsonl"
    run_batch(engine, inp, out, progress=False)
    with out.open("a") as f:  # what a mixed-up run leaves behind: an error line, junk, an object without an id
        f.write('{"line": 9, "id": "q9", "error": "prompt: bad"}\n{not json\n[1, 2]\n{"text": "x"}\n')
    _input(inp, 6)
    with caplog.at_level(logging.WARNING):
        summary = run_batch(engine, inp, out, progress=False)
    assert summary.requests == 2 and summary.skipped == 4
    assert "4 line(s) are not result lines" in caplog.text
    assert sorted(_ids(out)) == [f"q{i}" for i in range(6)]


def _cli(inp: Path, out: Path, file_limit: int | None) -> subprocess.CompletedProcess:
    """`paged-jax generate` in a child; with `file_limit` it runs under RLIMIT_FSIZE, SIGXFSZ ignored (so a write
    past the limit fails with EFBIG), both set by a tiny launcher that then execs the job (no fork hook here)."""
    args = ["-m", "paged_jax.offline.batch", "--model", "tiny", "--input", str(inp), "--output", str(out)]
    args += ["--no-progress"]
    args += ["--no-warmup", "--num-pages", "64", "--max-num-seqs", "4", "--attention-backend", "xla"]
    launcher = (
        "import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_limit}, {file_limit})); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    cmd = [sys.executable, "-c", launcher, *args] if file_limit else [sys.executable, *args]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_full_disk_is_one_clean_line_and_a_rerun_resumes(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse writes past 1,500 bytes (EFBIG), as a full disk refuses them (ENOSPC)."""
    inp, out = _input(tmp_path / "in.jsonl", 12), tmp_path / "out.jsonl"
    full = _cli(inp, out, file_limit=1500)
    assert full.returncode != 0
    assert "Traceback" not in full.stderr, full.stderr[-2000:]
    assert "a re-run resumes where this one stopped" in full.stderr.strip().splitlines()[-1]
    partial = out.read_text()
    assert partial.endswith("\n") and 0 < len(_ids(out)) < 12
    rerun = _cli(inp, out, file_limit=None)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert sorted(_ids(out)) == sorted(f"q{i}" for i in range(12))


def test_error_lines_keep_the_input_id_and_name_real_bounds(engine, tmp_path: Path) -> None:
    """Issue 41: a validation error lost the line's `id`, and a token-id error printed its bound as `None`."""
    lines = [
        {"id": "bias", "prompt": "x", "logit_bias": {"-1": 1}},
        {"id": 7, "prompt": "x", "stop_token_ids": [-3]},
        {"id": "deep-tools", "messages": [{"role": "user", "content": "x"}], "tools": "nope"},
        {"id": "good", "prompt": "x", "max_tokens": 2, "temperature": 0},
        {"id": "big-bias", "prompt": "x", "logit_bias": {"100000": 1}},  # checked by the engine, its vocabulary
    ]
    text = "\n".join(json.dumps(line) for line in lines)
    text += '\n{"id": "digits", "prompt": "x", "max_tokens": ' + "7" * 5000 + "}\n"
    (tmp_path / "in.jsonl").write_text(text)
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    errors = {e["id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert summary.errors == 5 and sorted(errors, key=str) == [7, "bias", "big-bias", "deep-tools", "digits"]
    assert errors["bias"] == "logit_bias: -1 is not a token id (a non-negative integer)"
    assert errors[7].startswith("stop_token_ids: -3 is not a token id")
    assert "[0, 320)" in errors["big-bias"] and "None" not in "".join(errors.values())
    assert errors["digits"].startswith("max_tokens: an integer of 5000 digits")
    assert engine.kv.stats().pages_in_use == 0

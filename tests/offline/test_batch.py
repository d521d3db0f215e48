"""Batch generation: nothing lost, nothing duplicated, bad lines reported, kill -9 survivable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.offline.batch import run_batch
from paged_jax.offline.lines import parse_line
from paged_jax.offline.multihost import _append_new
from paged_jax.offline.output_files import LineWriter, OutputLockedError, completed_ids
from paged_jax.offline.plan import plan_for_input
from paged_jax.tokenization.tokenizer import ByteTokenizer

from support.engines import make_engine

ROOT = Path(__file__).resolve().parents[2]


def write_input(path: Path, n: int, bad_lines: bool = True) -> set[str]:
    lines, ids = [], set()
    for i in range(n):
        lines.append(
            json.dumps(
                {
                    "id": f"q{i}",
                    "prompt": f"prompt number {i} " * (1 + i % 5),
                    "max_tokens": 8 + i % 7,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
            )
        )
        ids.add(f"q{i}")
        if bad_lines and i == 3:
            lines.append("{not json")
        if bad_lines and i == 5:
            lines.append(json.dumps({"id": "bad-temp", "prompt": "x", "temperature": -2}))
        if bad_lines and i == 6:
            lines.append(json.dumps({"id": "bad-field", "prompt": "x", "colour": "blue"}))
    path.write_text("\n".join(lines) + "\n")
    return ids


@pytest.fixture(scope="module")
def engine(tiny_config, tiny_params):
    return make_engine(tiny_config, tiny_params, num_pages=128)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_parse_line_names_the_field():
    with pytest.raises(ValueError, match="prompt"):
        parse_line('{"id": 1}', 1)
    with pytest.raises(ValueError, match="colour"):
        parse_line('{"id": 1, "prompt": "a", "colour": 1}', 1)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        parse_line('{"id": 1, "prompt_token_ids": "abc"}', 1)
    item = parse_line('{"prompt_token_ids": [5, 6], "max_tokens": 3, "seed": 4}', 7)
    assert item.id == "line-7" and item.prompt == [5, 6] and item.params.max_tokens == 3


def test_errors_are_reported_and_the_rest_goes_on(engine, tmp_path):
    ids = write_input(tmp_path / "in.jsonl", 12)
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert {r["id"] for r in out} == ids and len(out) == len(ids)
    assert all(r["usage"]["completion_tokens"] == len(r["token_ids"]) for r in out)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [e.get("line") for e in errors] == [5, 8, 10]
    assert "temperature" in errors[1]["error"] and "colour" in errors[2]["error"]
    assert summary.requests == 12 and summary.errors == 3
    check_manager_invariants(engine.kv)
    assert engine.kv.stats().pages_in_use == 0


def test_rerun_skips_done_ids_and_repairs_a_torn_tail(engine, tmp_path):
    ids = write_input(tmp_path / "in.jsonl", 10, bad_lines=False)
    out_path = tmp_path / "out.jsonl"
    run_batch(engine, tmp_path / "in.jsonl", out_path, progress=False)
    first = read_jsonl(out_path)
    kept = first[:4]
    out_path.write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"id": "q9", "te')  # a torn last line
    assert completed_ids(out_path) == {json.dumps(r["id"]) for r in kept}  # keys keep the JSON type
    summary = run_batch(engine, tmp_path / "in.jsonl", out_path, progress=False)
    final = read_jsonl(out_path)
    assert summary.skipped == 4 and summary.requests == 6
    assert sorted(r["id"] for r in final) == sorted(ids)
    by_id = {r["id"]: r["token_ids"] for r in first}
    assert all(by_id[r["id"]] == r["token_ids"] for r in final)  # greedy: the same tokens either way


@pytest.mark.slow  # a fresh process (start-up and compiles)
def test_kill_9_loses_nothing(tmp_path):
    ids = write_input(tmp_path / "in.jsonl", 60, bad_lines=False)
    out_path = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "paged_jax.offline.batch",
        "--model",
        "tiny",
        "--input",
        str(tmp_path / "in.jsonl"),
        "--output",
        str(out_path),
        "--no-progress",
        "--no-warmup",
        "--num-pages",
        "128",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--attention-backend",
        "xla",
    ]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out_path.exists() and out_path.read_text().count("\n") >= 5:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = out_path.read_text()
    assert partial.endswith("\n")
    done = [json.loads(line)["id"] for line in partial.splitlines()]
    assert 5 <= len(done) < 60
    rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    final = [r["id"] for r in read_jsonl(out_path)]
    assert sorted(final) == sorted(ids) and len(final) == len(set(final))
    assert f"{len(done)} skipped" in rerun.stdout.decode()


def test_lines_that_used_to_crash_the_job_fail_alone(engine, tmp_path):
    """Issue 14.5 and 14.7: invalid UTF-8, JSON nested past the recursion limit, an id no UTF-8 can hold and a
    `stop` that is an object each crashed the job (at the same line on every re-run) or passed silently. Each
    now fails alone into the errors file, once, however often the job is re-run."""
    good = [
        json.dumps({"id": f"g{i}", "prompt": "hello", "max_tokens": 3, "temperature": 0.0}).encode() for i in range(3)
    ]
    lines = [
        good[0],
        b'{"id": "bytes", "prompt": "caf\xe9"}',
        good[1],
        b"[" * 100_000,
        b'{"id": "\\ud800", "prompt": "x"}',
        b'{"id": "stop-obj", "prompt": "x", "stop": {"x": 1}}',
        good[2],
    ]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    for _ in range(2):
        summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert summary.errors == 4
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == ["g0", "g1", "g2"]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [e["line"] for e in errors] == [2, 4, 5, 6]  # once each, although the job ran twice
    assert "UTF-8" in errors[0]["error"] and "nested" in errors[1]["error"]
    assert errors[2]["error"].startswith("id:") and errors[3]["error"].startswith("stop:")
    assert engine.kv.stats().pages_in_use == 0


def test_a_second_run_on_the_same_output_is_refused(engine, tmp_path):
    """Issue 14.6: two runs on one output both resumed from the same state and wrote every id twice."""
    write_input(tmp_path / "in.jsonl", 3, bad_lines=False)
    other = LineWriter(tmp_path / "out.jsonl")
    other.lock()  # another run holds the output
    try:
        with pytest.raises(OutputLockedError, match="another run"):
            run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
        assert (tmp_path / "out.jsonl").read_bytes() == b""
    finally:
        other.close()
    run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)  # free again: it runs
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 3


def test_ids_keep_their_type_and_samples_their_logprobs(engine, tmp_path):
    """Issue 14.7: integer id 1 came back as "1" (colliding with the string id "1"); n>1 choices had no logprobs."""
    lines = [
        {"id": 1, "prompt": "a", "max_tokens": 2, "temperature": 0.0},
        {"id": "1", "prompt": "b", "max_tokens": 2, "temperature": 0.0},
        {"id": "n2", "prompt": "c", "max_tokens": 3, "n": 2, "logprobs": 1, "seed": 0},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    out = {json.dumps(r["id"]): r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert set(out) == {"1", '"1"', '"n2"'}
    assert completed_ids(tmp_path / "out.jsonl") == set(out)
    choices = out['"n2"']["choices"]
    assert [len(c["logprobs"]) for c in choices] == [3, 3]
    assert [lp["token_id"] for lp in choices[0]["logprobs"]] == choices[0]["token_ids"]
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert summary.skipped == 3 and summary.requests == 0


def test_a_request_failed_by_the_engine_is_reported_and_retried(engine, tmp_path, monkeypatch):
    """Issue 14.7: a request that failed inside the engine was written as done (never retried, error lost)."""
    write_input(tmp_path / "in.jsonl", 3, bad_lines=False)
    real_append = engine._append

    def append(req, seq, result, row):
        if req.request_id == '"q1"':
            raise RuntimeError("injected tokenizer failure")
        return real_append(req, seq, result, row)

    monkeypatch.setattr(engine, "_append", append)
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert summary.errors == 1 and summary.requests == 2
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == ["q0", "q2"]
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["id"] == "q1" and "injected tokenizer failure" in error["error"]
    monkeypatch.undo()
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert summary.requests == 1 and summary.skipped == 2
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == ["q0", "q1", "q2"]
    assert engine.kv.stats().pages_in_use == 0


def test_merge_survives_torn_tails(tmp_path):
    """Issue 14.7: a torn last line (a crash mid-write) in the merged output or a part broke the next merge."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "a"}\n{"id": "b", "te')
    parts = [b'{"id": "a"}\n{"id": 1}\n', b'{"id": "b"}\n{"id": "1"}\n{"id": "c", "tok']
    assert _append_new(out, parts, key=lambda line: json.dumps(json.loads(line)["id"])) == 3
    assert [r["id"] for r in read_jsonl(out)] == ["a", 1, "b", "1"]


def test_the_warmup_plan_skips_lines_already_written(engine, tmp_path):
    """A resumed run plans for the lines it still has to run: the output's ids are JSON keys (`"a"`), so the
    plan compared the raw id (`a`) with them and planned the written `n=2` line's copies and budget too."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"id": "a", "prompt": "already written", "n": 2, "temperature": 0.0, "max_tokens": 30},
        {"id": "b", "prompt": "to do", "temperature": 0.0, "max_tokens": 3},
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out.write_text(json.dumps({"id": "a", "text": "..."}) + "\n")
    plan = plan_for_input(engine, inp, out)
    assert plan.copies is False  # only `b` (n=1) is left
    assert plan.max_step_tokens == len(engine.tokenizer.encode("to do")) + 3
    assert plan_for_input(engine, inp, tmp_path / "none.jsonl").copies is True  # from scratch `a` is planned


def test_planning_never_cuts_a_file_another_run_holds(engine, tmp_path):
    """The plan is read before this run takes the output's lock: it must not repair (truncate) a torn tail
    then, since the torn line may be one another run, holding the lock, is writing right now."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "b", "prompt": "to do", "max_tokens": 3}) + "\n")
    data = (json.dumps({"id": "a", "text": "done"}) + "\n" + '{"id": "b", "te').encode()
    out.write_bytes(data)
    other = LineWriter(out)
    other.lock()  # another run holds the output
    try:
        plan_for_input(engine, inp, out)
        assert out.read_bytes() == data
        with pytest.raises(OutputLockedError):
            run_batch(engine, inp, out, progress=False)
        assert out.read_bytes() == data
    finally:
        other.close()


def test_prompt_logprobs_logit_bias_and_scoring_lines(engine, tmp_path):
    """Batch lines take `prompt_logprobs` (written as the engine computes them: null first, then token id,
    logprob, top), `max_tokens: 0` and `logit_bias` with JSON's string keys; a bad key fails its line alone."""
    from paged_jax.sampling_params import SamplingParams

    prompt = "score this prompt"
    q = ByteTokenizer().encode("Q", add_special_tokens=False)[0]
    lines = [
        {"id": "s", "prompt": prompt, "max_tokens": 0, "prompt_logprobs": 2},
        {
            "id": "b",
            "prompt": "x",
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "logit_bias": {str(q): 100},
        },
        {"id": "bad", "prompt": "x", "logit_bias": {"Q": 1}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    out = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert summary.errors == 1 and "logit_bias" in read_jsonl(tmp_path / "out.errors.jsonl")[0]["error"]
    assert out["b"]["text"] == "QQQQ"
    scored = out["s"]
    assert scored["token_ids"] == [] and scored["finish_reason"] == "length" and "prompt_logprobs" not in out["b"]
    engine.add_request("ref", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    ref = None
    while engine.has_unfinished():
        for o in engine.step():
            ref = o if o.finished else ref
    want = [None] + [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in ref.prompt_logprobs[1:]]
    assert json.loads(json.dumps(want)) == scored["prompt_logprobs"]
    assert len(want) == len(ByteTokenizer().encode(prompt)) and all(len(lp["top"]) == 2 for lp in want[1:])
    check_manager_invariants(engine.kv)
    assert engine.kv.stats().pages_in_use == 0

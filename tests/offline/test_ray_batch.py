"""The batch job's engine as a Ray Data stage: on a local Ray cluster with 2 engine actors, the output is the JSONL
job's (greedy, the same lines), bad lines go to the errors file alone, and a re-run after a partial output completes
it without duplicates."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from paged_jax.engine.args import build_engine
from paged_jax.offline.batch import run_batch
from paged_jax.offline.ray_batch import run_on_ray
from serve.main import parse_args

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--model", "tiny", "--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
FLAGS += ["--attention-backend", "xla", "--no-warmup"]


def write_input(path: Path) -> None:
    lines = [json.dumps({"id": f"r{i}", "prompt": f"prompt number {i} " * (i + 1), "max_tokens": 5, "temperature": 0})
             for i in range(6)]  # fmt: skip
    lines.insert(2, '{"id": "bad", "prompt": "x", "max_tokens": -1}')
    lines.append(json.dumps({"prompt": "no id here", "max_tokens": 3, "temperature": 0}))  # its id: line-8
    path.write_text("\n".join(lines) + "\n")


def read(path: Path) -> dict:
    return {json.loads(line)["id"]: json.loads(line) for line in path.read_text().splitlines()}


@pytest.mark.slow  # a local Ray cluster and two engine actors
def test_ray_stage_matches_the_jsonl_job_and_resumes(tmp_path):
    import ray  # the ray extra (in dev); imported here, since importing it takes seconds

    args, _ = parse_args(["generate", "--input", "in", "--output", "out", *FLAGS])
    src = tmp_path / "in.jsonl"
    write_input(src)
    ref = tmp_path / "ref.jsonl"
    run_batch(build_engine(args, warmup=False), src, ref, progress=False)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        factory = functools.partial(build_engine, args, warmup=False)
        out = tmp_path / "out.jsonl"
        summary = run_on_ray(factory, src, out, num_actors=2, batch_size=2)
        assert (summary.requests, summary.errors, summary.already_done) == (7, 1, 0)
        got, want = read(out), read(ref)
        assert set(got) == set(want) == {*(f"r{i}" for i in range(6)), "line-8"}
        for rid, line in want.items():
            assert got[rid]["token_ids"] == line["token_ids"] and got[rid]["text"] == line["text"]
        (err,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
        assert err["id"] == "bad" and err["line"] == 3 and "max_tokens" in err["error"]
        # A crash after three lines: the re-run writes the other four, once.
        kept = out.read_text().splitlines()[:3]
        out.write_text("\n".join(kept) + "\n")
        again = run_on_ray(factory, src, out, num_actors=2, batch_size=2)
        assert (again.requests, again.already_done) == (4, 3)
        lines = out.read_text().splitlines()
        assert len(lines) == 7 and read(out).keys() == want.keys()
        assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 1  # not repeated
    finally:
        ray.shutdown()

"""scripts/checks/gpu_check.py as the bare device machine runs it: a subprocess from the repository root with $OUT
set, in an interpreter where the packages that image lacks cannot be imported (a ``sitecustomize`` on
PYTHONPATH blocks them, and paged_jax, for the script and every child it starts). The dry run lists the GPU
cases and writes the files; a tiny CPU run leaves every row finished and passed; a corrupted block table makes
the page-id probe fail, so the check is seen to be able to fail."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = REPO / "scripts" / "checks" / "gpu_check.py"
# What the bare H200 image does not have (and the project itself, which is not installed there).
ABSENT = ("flax", "tqdm", "jinja2", "llguidance", "safetensors", "tokenizers", "gguf", "orbax", "xxhash", "paged_jax")
_BLOCKER = f"""
import sys
ABSENT = {ABSENT!r}
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not on the device image)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


def _run(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env |= {"PYTHONPATH": str(site), "OUT": str(tmp_path / "out"), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def _summary(tmp_path: pathlib.Path) -> dict:
    return json.loads((tmp_path / "out" / "summary.json").read_text())


def test_the_blocker_blocks(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", "import flax"], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "blocked: not on the device image" in res.stderr


@pytest.mark.slow
def test_dry_run_lists_the_gpu_cases_and_writes_the_files(tmp_path):
    res = _run(tmp_path, "--dry-run")
    assert res.returncode == 0, res.stderr
    s = _summary(tmp_path)
    names = [r["case"] for r in s["rows"]]
    assert len(names) == len(set(names)) and all(r["state"] == "planned" for r in s["rows"])
    assert {g["group"] for g in s["groups"]} >= {"env", "bandwidth", "probe-bfloat16", "exact", "addressing-int8"}
    for kv in ("bfloat16", "float32", "int8", "fp8"):
        for batch in ("decode-b64x4k", "decode-b1x32k", "prefill-8x512@4k", "mixed2048"):
            assert f"probe/{batch}-d128-{kv}-pallas-gpu" in names
    for kv in ("int8", "bfloat16", "fp8"):
        for over in ("over-2^31-2layers", "over-2^32-4layers"):
            assert f"addressing/{over}-decode-b1x32k-d128-{kv}-pallas-gpu" in names
    big = next(r for r in s["rows"] if r["case"].startswith("addressing/over-2^32"))
    assert big["cache_elements"] > 2**32
    assert (tmp_path / "out" / "summary.md").read_text().count("| probe/") >= 16
    assert (tmp_path / "out" / "env" / "flags.txt").exists()

    part2 = _run(tmp_path, "--dry-run", "--part", "2")
    assert part2.returncode == 0, part2.stderr
    names2 = [r["case"] for r in _summary(tmp_path)["rows"]]
    assert any(n.startswith("timing/") for n in names2) and any("-d256-" in n for n in names2)
    assert not set(names) & set(names2)


@pytest.mark.slow
def test_a_tiny_cpu_run_finishes_every_case_and_passes(tmp_path):
    only = "env/,bandwidth/,probe/decode-b4x200,exact/,addressing/,timing/"
    res = _run(tmp_path, "--platform", "cpu", "--groups", "env,bandwidth,probe,exact,addressing,timing", "--only", only)
    assert res.returncode == 0, res.stdout + res.stderr
    s = _summary(tmp_path)
    assert [g["state"] for g in s["groups"]] == ["done"] * 6
    rows = {r["case"]: r for r in s["rows"]}
    assert all(r["state"] == "finished" for r in rows.values())
    assert {r["status"] for r in rows.values()} == {"pass", "measured"}
    probe = rows["probe/decode-b4x200-d128-bfloat16-xla"]
    assert probe["passed"] and probe["score"] <= 1 and probe["wrong_page_score"] >= 4
    assert rows["addressing/3layers-top-pages-d128-int8-xla"]["passed"]
    assert rows["timing/decode-b4x200-d128-bfloat16-xla"]["wall_us"] > 0
    started = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert sum(r["state"] == "started" for r in started) == len(rows)
    out = tmp_path / "out"
    assert "jax" in (out / "env" / "jax_environment.txt").read_text()
    assert (out / "logs" / "probe.log").exists() and (out / "bandwidth.json").exists()


@pytest.mark.slow
def test_a_corrupted_block_table_fails_the_probe(tmp_path):
    res = _run(tmp_path, "--platform", "cpu", "--groups", "probe", "--only", "decode-b4x200", "--corrupt-table")
    assert res.returncode == 1
    (row,) = _summary(tmp_path)["rows"]
    assert row["state"] == "finished" and row["status"] == "FAIL" and row["corrupted_table"]
    assert row["finite"] and row["score"] > 4 and "x the bound" in row["reason"]


@pytest.mark.slow
def test_a_gpu_run_without_a_gpu_backend_runs_nothing(tmp_path):
    """If the CUDA plugin does not load, JAX falls back to the CPU: no full-size case may run there."""
    res = _run(tmp_path, "--groups", "env,bandwidth")
    assert res.returncode == 1
    rows = _summary(tmp_path)["rows"]
    assert [r["status"] for r in rows] == ["error", "error"]
    assert all("JAX backend is cpu, not gpu" in r["error"] for r in rows)


@pytest.mark.slow
def test_a_killed_or_crashed_group_leaves_finished_rows(tmp_path):
    """A group past its timeout is killed and a child that dies leaves no case unaccounted for."""
    import dataclasses
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)  # puts scripts/checks on sys.path
    import device_groups
    import device_report

    args = gpu_check._parse(["--platform", "cpu", "--out", str(tmp_path)])
    group = next(g for g in device_groups.cpu_groups() if g.name == "probe")
    assert gpu_check._run_group(args, group, timeout_s=1.0)["state"] == "timeout"  # killed while importing jax
    rows = device_report.latest_by_case(device_report.read_rows(tmp_path))
    assert {rows[c.name]["status"] for c in group.cases} <= {"timeout", "not run"}
    assert all(rows[c.name]["state"] == "finished" for c in group.cases)
    assert f"--groups probe --only {group.cases[0].name}" in rows[group.cases[0].name]["reason"]

    other = tmp_path / "crash"
    other.mkdir()
    args = gpu_check._parse(["--platform", "cpu", "--out", str(other)])
    gone = dataclasses.replace(group, name="no-such-group")  # the child dies before its first case
    info = gpu_check._run_group(args, gone, timeout_s=120)
    assert info["state"] == "crashed" and info["rc"] != 0
    rows = device_report.latest_by_case(device_report.read_rows(other))
    assert {rows[c.name]["status"] for c in group.cases} == {"not run"}
    assert "StopIteration" in (other / "logs" / "no-such-group.log").read_text()

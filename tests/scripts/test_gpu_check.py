"""scripts/gpu_check.py cannot rot unseen: its dry run plans every case on CPU (shapes, work model, the engine's
config and sampling parameters), and a correctness case runs here on the XLA path."""

import importlib.util
import pathlib
import sys

import jax
import pytest

_PATH = pathlib.Path(__file__).parents[2] / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", _PATH)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)


def test_dry_run_plans_every_case(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    names = [c.name for c in gpu_check.cases()]
    assert len(names) == len(set(names))
    for name in names:
        assert f"plan {name}:" in out
    groups = {n.split("/")[0] for n in names}
    assert groups == {"target", "bandwidth", "correct", "decode", "prefill", "sweep", "engine"}
    assert f"{len(names)} case(s) planned" in out


def test_quick_is_a_subset_with_every_group(capsys):
    assert gpu_check.main(["--dry-run", "--quick"]) == 0
    quick = [c.name for c in gpu_check.cases() if c.quick]
    assert 0 < len(quick) < len(gpu_check.cases())
    assert {n.split("/")[0] for n in quick} >= {"target", "correct", "decode", "prefill", "engine"}
    assert f"{len(quick)} case(s) planned" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal off a GPU")
def test_refuses_to_measure_without_a_gpu(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--only", "bandwidth"]) == 2
    assert not (tmp_path / "gpu_check.jsonl").exists()


def test_a_correctness_case_runs_on_the_xla_path():
    spec = gpu_check.CORRECT[2]  # bf16 MQA, 32 tokens
    assert gpu_check._correct(spec, "xla")({})["seqs"] > 0

"""`scripts/bench/load_test.py --soak`: its arguments, and the table and verdict it prints for a soak's result (a
made-up result here; the soak itself is a script run, its figures in docs/benchmarks/soak.md)."""

import dataclasses
import importlib.util
import pathlib
import sys
from collections import Counter

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "scripts" / "bench" / "load_test.py"
_spec = importlib.util.spec_from_file_location("load_test", _PATH)
load_test = importlib.util.module_from_spec(_spec)
sys.modules["load_test"] = load_test  # dataclasses look their module up there
_spec.loader.exec_module(load_test)

GOOD = load_test.SoakResult(
    seconds=180.2,
    outcomes=Counter({"HTTP 200": 900, "HTTP 400": 120, "HTTP 405": 30, "gRPC OK": 400, "gRPC INVALID_ARGUMENT": 40}),
    latencies_s=[0.1 * i for i in range(1, 101)],
    victim_s=[0.1 * i for i in range(51, 101)],  # the second half: sent after the warm-up
    ttft_s=[0.01] * 10,
    client_errors_500=0,
    grpc_internal=0,
    rss_start_mib=800.0,
    rss_end_mib=820.0,
    pages_in_use=0,
    pages_total=2048,
    open_requests=0,
    invariants="ok",
    compiles_after_warmup=0,
    compiles_during_soak=0,
    error_log_lines=0,
    load_average="3.1 4.0 5.2",
)


def test_soak_arguments():
    assert load_test.parse_args(["--soak", "180"]).soak == 180
    assert load_test.parse_args([]).soak is None
    for bad in (["--soak", "0"], ["--soak", "10", "--target", "127.0.0.1:1"]):
        with pytest.raises(SystemExit):
            load_test.parse_args(bad)


def test_soak_table_passes_a_clean_run():
    table, ok = load_test.soak_report(GOOD)
    assert ok
    assert "| outcome HTTP 405" in table and "| 30 |" in table
    assert "p50 5100 ms, p99 10000 ms (100 requests)" in table
    assert "victim latency" in table and "p50 7600 ms, p99 10000 ms (50 requests)" in table
    assert "800 -> 820 MiB (+2.5%)" in table
    assert table.count("| pass |") == 5 and "FAIL" not in table


@pytest.mark.parametrize(
    "change, goal",
    [
        ({"client_errors_500": 1}, "0 HTTP 5xx"),
        ({"grpc_internal": 2}, "0 gRPC INTERNAL"),
        ({"compiles_after_warmup": 1}, "0 compiles after warm-up"),
        ({"compiles_during_soak": 1}, "0 compiles after warm-up"),
        ({"rss_end_mib": 841.0}, "RSS growth < 5% after the first 10 s"),
        ({"pages_in_use": 3}, "every page free at the end"),
        ({"open_requests": 1}, "every page free at the end"),
        ({"invariants": "page 7 leaked"}, "every page free at the end"),
    ],
)
def test_soak_fails_the_goal_a_result_misses(change, goal):
    table, ok = load_test.soak_report(dataclasses.replace(GOOD, **change))
    assert not ok
    assert f"| goal: {goal}" in table
    (failed,) = [line for line in table.splitlines() if "FAIL" in line]
    assert goal in failed

"""The device check of paged-jax on a bare NVIDIA GPU machine (made for an H200), unattended, results in ``$OUT``.

    python3 scripts/checks/gpu_check.py              # part 1: probes, random exactness, full-size addressing
    python3 scripts/checks/gpu_check.py --part 2     # part 2: timings, head_dim 64/256, large random cases
    python3 scripts/checks/gpu_check.py --dry-run    # list the cases and write the files, run nothing heavy
    python3 scripts/checks/gpu_check.py --platform cpu   # the same code at toy sizes on the CPU backend

Run from the repository root with nothing installed but jax, jaxlib and numpy: the script puts the repository
on ``sys.path`` itself and imports only ``pallas_kernels`` and its own helpers in ``scripts/checks/``. Files go
to ``$OUT`` (``--out``; default ``out/device_check``): ``rows.jsonl`` (a ``started`` and a ``finished`` row per
case, flushed as they happen), ``summary.json`` and ``summary.md`` (rewritten after every group), ``env/``
(``nvidia-smi -q``, ``jax.print_environment_info()``, the XLA/JAX variables) and ``logs/<group>.log``.

Each group of cases (:mod:`device_groups`; how a case runs: :mod:`device_cases`) runs in a child process with
its own timeout: a crash, an illegal address or a hang ends that group only, its running case gets a
``crashed``/``timeout`` row and the next group starts. A global deadline (``--deadline-s``, 510 s) skips the
groups that no longer fit (``skipped: deadline`` rows; rerun them with ``--groups``). The engine end to end and
the fused model step are not here: they import flax (and the engine tqdm, jinja2, tokenizers, ...), which the
bare image does not have.

Exit status: 0 when every case that ran passed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
for _path in (str(_HERE), str(_REPO)):  # the project is not installed on the device machine
    if _path not in sys.path:
        sys.path.insert(0, _path)

import device_cases  # noqa: E402
import device_groups  # noqa: E402
import device_report  # noqa: E402

DEADLINE_S = 510.0  # of a 10-minute command: start-up, the last group's kill and the summary fit in the rest
MIN_GROUP_S = 20.0  # a group is not started with less time than this left


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="results folder (default $OUT, else out/device_check)"
    )
    p.add_argument("--part", type=int, choices=(1, 2), default=1)
    p.add_argument("--groups", default=None, help="comma-separated group names to run (any part), e.g. timing")
    p.add_argument("--only", default=None, help="comma-separated substrings: only the cases whose name has one")
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--dry-run", action="store_true", help="list the cases and write the files; run nothing")
    p.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    p.add_argument("--corrupt-table", action="store_true", help="give the probes a wrong page: they must fail")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one group in this process
    args = p.parse_args(argv)
    args.out = args.out or pathlib.Path(os.environ.get("OUT") or "out/device_check")
    return args


def _selected(args) -> list:
    """The groups of ``--part`` (or ``--groups``), each cut to the cases ``--only`` names."""
    import dataclasses

    groups = device_groups.groups_for(args.platform)
    if args.groups:
        names = args.groups.split(",")
        unknown = sorted(set(names) - {g.name for g in groups})
        if unknown:
            raise SystemExit(f"--groups: unknown {unknown}; known: {[g.name for g in groups]}")
        groups = [g for g in groups if g.name in names]
    elif not args.child:
        groups = [g for g in groups if g.part == args.part]
    if args.only:
        keep = args.only.split(",")
        groups = [
            dataclasses.replace(g, cases=tuple(c for c in g.cases if any(k in c.name for k in keep))) for g in groups
        ]
        groups = [g for g in groups if g.cases]
    return groups


def run_child(args) -> int:
    """Runs one group's cases in this process, a ``started`` and a ``finished`` row each."""
    group = next(g for g in _selected(args) if g.name == args.child)
    if args.platform == "gpu":  # later groups and part 2 reuse earlier compiles (write_kv, references, kernels)
        import jax

        jax.config.update("jax_compilation_cache_dir", str(_REPO / "out" / "device_check_jax_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    ctx = device_cases.Context(out=args.out, platform=args.platform, corrupt_table=args.corrupt_table)
    backend = _backend()
    if backend != args.platform:  # e.g. the CUDA plugin failed to load: never run full sizes on the CPU
        for case in group.cases:
            row = {"case": case.name, "group": group.name, "state": "finished", "status": "error"}
            device_report.append_row(args.out, row | {"error": f"JAX backend is {backend}, not {args.platform}"})
        return 1
    for case in group.cases:
        device_report.append_row(args.out, {"case": case.name, "group": group.name, "state": "started"})
        print(f"start {case.name}", flush=True)
        t0 = time.perf_counter()
        try:
            result = case.run(ctx)
            status = ("pass" if result["passed"] else "FAIL") if "passed" in result else "measured"
        except Exception as e:  # noqa: BLE001 - one case's exception is its result
            result = {"error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc(limit=6)}
            status = "error"
        row = {"case": case.name, "group": group.name, "state": "finished", "status": status}
        row |= {"seconds": round(time.perf_counter() - t0, 2), **result}
        device_report.append_row(args.out, row)
        print(f"{status:<8} {case.name} {row['seconds']}s {result.get('reason', result.get('error', ''))}", flush=True)
    return 0


def _backend() -> str:
    import jax

    try:
        return jax.default_backend()
    except RuntimeError as e:  # no backend at all
        return f"none ({e})"


def _run_group(args, group, timeout_s: float) -> dict:
    """One child process for ``group``; afterwards a row for each of its cases that did not finish."""
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    cmd = [sys.executable, "-u", str(pathlib.Path(__file__).resolve()), "--child", group.name]
    cmd += ["--platform", args.platform, "--out", str(args.out)] + (["--corrupt-table"] if args.corrupt_table else [])
    cmd += ["--only", args.only] if args.only else []
    env = dict(os.environ)
    if args.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    with (logs / f"{group.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc, state = proc.wait(timeout=timeout_s), "done"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, state = proc.wait(), "timeout"
    if state == "done" and rc != 0:
        state = "crashed"
    latest = device_report.latest_by_case(device_report.read_rows(args.out))
    for case in group.cases:
        row = latest.get(case.name)
        if row is not None and row["state"] == "finished":
            continue
        status = state if row is not None else "not run"
        reason = f"group {state} (rc {rc}) " + ("while this case ran" if row else "before this case started")
        reason += f"; rerun with --groups {group.name} --only {case.name}"
        device_report.append_row(
            args.out, {"case": case.name, "group": group.name, "state": "finished", "status": status, "reason": reason}
        )
    return {"state": state, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        return run_child(args)
    t_start = time.perf_counter()
    groups = _selected(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / device_report.ROWS).unlink(missing_ok=True)
    meta = {"part": args.part, "platform": args.platform, "dry_run": args.dry_run, "deadline_s": args.deadline_s}
    meta["not_covered"] = device_groups.NOT_COVERED
    meta |= {
        "corrupt_table": args.corrupt_table,
        "command": " ".join(sys.argv),
        **device_report.capture_host_env(args.out),
    }
    planned = [{"case": c.name, "group": g.name, "plan": c.plan} for g in groups for c in g.cases]
    info = [{"group": g.name, "part": g.part, "timeout_s": g.timeout_s, "state": "pending"} for g in groups]
    if args.dry_run:
        for g in groups:
            print(f"group {g.name} (part {g.part}, timeout {g.timeout_s:.0f} s)")
            for c in g.cases:
                print(f"  {c.name}")
                device_report.append_row(
                    args.out, {"case": c.name, "group": g.name, "state": "planned", "status": "dry-run", **c.plan}
                )
        for g in info:
            g["state"] = "dry-run"
        device_report.write_summary(args.out, meta, planned, info)
        print(f"{len(planned)} case(s) in {len(groups)} group(s); files in {args.out}")
        return 0
    device_report.write_summary(args.out, meta, planned, info)
    for group, gi in zip(groups, info, strict=True):
        left = args.deadline_s - (time.perf_counter() - t_start)
        if left < MIN_GROUP_S:
            gi["state"] = "skipped: deadline"
            for c in group.cases:
                device_report.append_row(
                    args.out,
                    {"case": c.name, "group": group.name, "state": "finished", "status": "skipped"}
                    | {"reason": f"deadline: rerun with --groups {group.name}"},
                )
        else:
            print(f"group {group.name}: timeout {min(group.timeout_s, left):.0f} s", flush=True)
            gi |= _run_group(args, group, min(group.timeout_s, left))
        summary = device_report.write_summary(args.out, meta, planned, info)
    print((args.out / "summary.md").read_text())
    bad = {k: v for k, v in summary["counts"].items() if k not in ("pass", "measured")}
    print(f"{time.perf_counter() - t_start:.0f} s; not passed: {bad or 'none'}; files in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

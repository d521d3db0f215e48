"""How long does `make run` take from command to summary, cold and warm, and are the outputs the same?

Runs the `paged-jax generate` command of the Makefile's `run` target in fresh processes: first cold (an empty
persistent compile cache and no built CPU attention kernel), then warm (the caches the cold run filled),
`--rounds` times each, alternating, and prints each run's wall time (process start to exit: the summary is its
last output) and CPU time, the start-up line of its summary, whether every run wrote the same token ids and
text, and the goals (issue 28, SmolLM2-135M-Instruct: cold <= 40 s, warm <= 15 s on 2 cores). The machine's
load average is printed too: on a shared machine the wall times move with it (the CPU times much less), so
compare runs of one invocation.

    .venv/bin/python scripts/startup_time.py [--rounds 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_COLD_S, GOAL_WARM_S = 40.0, 15.0


def make_run_command() -> list[str]:
    """The `paged-jax generate ...` line of the Makefile's `run` target, as an argument list."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^run:.*?\n((?:\t.*\n)+)", text, re.M)
    if recipe is None:
        raise SystemExit("Makefile: no `run` target")
    line = next((x for x in recipe.group(1).splitlines() if "paged-jax generate" in x), None)
    if line is None:
        raise SystemExit("Makefile: the `run` target has no `paged-jax generate` command")
    args = shlex.split(line.split("paged-jax", 1)[1])
    return [sys.executable, "-m", "serve", *args]


def with_output(cmd: list[str], output: Path) -> list[str]:
    out = list(cmd)
    i = out.index("--output")
    out[i + 1] = str(output)
    return out


def run_once(cmd: list[str], cache: Path, output: Path) -> tuple[float, float, str, list]:
    """(wall seconds, CPU seconds of the process, its summary's start-up line, its outputs). Cold means both
    caches empty: the XLA executables' and the CPU attention kernel's (`pallas_kernels.cpu_paged`, built by g++
    once per machine)."""
    env = dict(os.environ, PAGED_JAX_COMPILE_CACHE=str(cache), PAGED_JAX_KERNEL_CACHE=str(cache / "kernels"))
    output.unlink(missing_ok=True)
    output.with_name(output.stem + ".errors.jsonl").unlink(missing_ok=True)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*with_output(cmd, output), "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    startup = next((x.strip() for x in proc.stdout.splitlines() if x.startswith("start-up")), "")
    rows = sorted((json.loads(x) for x in output.read_text().splitlines()), key=lambda d: str(d["id"]))
    return seconds, cpu, startup, [(d["id"], d["token_ids"], d["text"]) for d in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="cold and warm runs each")
    ap.add_argument("--keep", type=Path, default=None, help="work directory to keep (default: a temporary one)")
    args = ap.parse_args()
    cmd = make_run_command()
    work = args.keep or Path(tempfile.mkdtemp(prefix="paged-jax-startup-"))
    work.mkdir(parents=True, exist_ok=True)
    print("command:", " ".join(shlex.quote(c) for c in cmd))
    print(f"cpus: {len(os.sched_getaffinity(0))}; load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    outputs = []
    for r in range(args.rounds):
        cache = work / f"cache-{r}"
        subprocess.run(["rm", "-rf", str(cache)], check=True)
        for kind in ("cold", "warm"):
            seconds, cpu, startup, rows = run_once(cmd, cache, work / f"{kind}-{r}.jsonl")
            times[kind].append(seconds)
            outputs.append(rows)
            load = os.getloadavg()[0]
            print(f"{kind} #{r + 1}: {seconds:6.1f} s wall, {cpu:5.1f} s CPU (load {load:.1f})  {startup}")
    same = all(rows == outputs[0] for rows in outputs)
    cold, warm = min(times["cold"]), min(times["warm"])
    print(
        f"\ncold {cold:.1f} s (goal <= {GOAL_COLD_S:.0f} s: {'met' if cold <= GOAL_COLD_S else 'NOT met'}), "
        f"warm {warm:.1f} s (goal <= {GOAL_WARM_S:.0f} s: {'met' if warm <= GOAL_WARM_S else 'NOT met'}), "
        f"warm/cold {warm / cold:.2f}; outputs identical across runs: {same}"
    )
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

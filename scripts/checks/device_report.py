"""The device check's files under ``$OUT``: the rows log, ``summary.json``, ``summary.md`` and ``env/``.

``rows.jsonl`` is the log both processes append to (one JSON object a line, flushed and fsynced): a
``started`` row before a case runs and a ``finished`` row after it (or, written by the parent, when its child
crashed or timed out). :func:`write_summary` folds it into one row per case, so a run cut short at any point
leaves a summary that says what finished, what was running, and what never started.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time

ROWS = "rows.jsonl"
# Columns of summary.md beyond case, status and seconds, when a row has them.
COLUMNS = (
    "score",
    "wrong_page_score",
    "err_rel_rms",
    "tol_rel_rms",
    "kernel_us",
    "wall_us",
    "model_us",
    "copy_GBps",
    "GBps",
    "pct_of_copy_bw",
    "useful_TFLOPs",
)


def append_row(out: pathlib.Path, row: dict) -> None:
    """Appends one row to the log and makes it durable (a crash right after it keeps it)."""
    with (out / ROWS).open("a") as f:
        f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(out: pathlib.Path) -> list[dict]:
    path = out / ROWS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill: the case shows as started only
            continue
    return rows


def latest_by_case(rows: list[dict]) -> dict[str, dict]:
    """The last row of each case (``finished`` wins over ``started`` because it comes later)."""
    latest: dict[str, dict] = {}
    for row in rows:
        latest[row["case"]] = row
    return latest


def write_summary(out: pathlib.Path, meta: dict, planned: list[dict], groups: list[dict]) -> dict:
    """``summary.json`` (meta, groups, one row per planned case) and ``summary.md`` (the same as a table)."""
    latest = latest_by_case(read_rows(out))
    rows = []
    for plan in planned:
        row = latest.get(plan["case"], {"case": plan["case"], "group": plan["group"], "state": "not started"})
        rows.append({"status": row.get("status", "-"), **row})
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    summary = {**meta, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "counts": counts}
    summary |= {"groups": groups, "rows": rows}
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    (out / "summary.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    """The summary as Markdown: a header line, the groups, and one table row per case."""
    head = f"# Device check, part {summary['part']} ({summary['platform']})\n\n"
    device = next((r["device"] for r in summary["rows"] if "device" in r), "device unknown")
    head += f"{device}; {summary['written_at']}; counts {summary['counts']}\n\n"
    head += "| group | state | rc | seconds | timeout s |\n|---|---|---|---|---|\n"
    for g in summary["groups"]:
        head += f"| {g['group']} | {g['state']} | {g.get('rc', '')} | {g.get('seconds', '')} | {g['timeout_s']} |\n"
    cols = [c for c in COLUMNS if any(c in r for r in summary["rows"])]
    header = ["case", "state", "status", "s", *cols, "note"]
    table = "\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|\n"
    for r in summary["rows"]:
        note = str(r.get("reason") or r.get("error") or "")[:160].replace("|", "/").replace("\n", " ")
        cells = [
            r["case"],
            r.get("state", ""),
            r["status"],
            _fmt(r.get("seconds")),
            *(_fmt(r.get(c)) for c in cols),
            note,
        ]
        table += "| " + " | ".join(cells) + " |\n"
    return head + table


def capture_host_env(out: pathlib.Path) -> dict:
    """``env/nvidia-smi.txt`` (``nvidia-smi -q``, when present) and ``env/flags.txt`` (XLA/JAX/CUDA variables)."""
    env = out / "env"
    env.mkdir(parents=True, exist_ok=True)
    found = {}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=30)
            (env / "nvidia-smi.txt").write_text(res.stdout + res.stderr)
            found["nvidia_smi"] = "env/nvidia-smi.txt"
        except (OSError, subprocess.SubprocessError) as e:
            found["nvidia_smi"] = f"failed: {type(e).__name__}"
    else:
        found["nvidia_smi"] = "not on PATH"
    keys = sorted(k for k in os.environ if k.startswith(("XLA_", "JAX_", "CUDA_", "TF_", "NVIDIA_")))
    (env / "flags.txt").write_text("".join(f"{k}={os.environ[k]}\n" for k in keys) or "(none set)\n")
    found["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return found


def _fmt(x) -> str:
    if isinstance(x, bool) or x is None:
        return "" if x is None else str(x)
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _jsonable(x):
    if isinstance(x, (int, float, str, bool, type(None))):
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)

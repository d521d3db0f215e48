"""Running a test file's mesh tests in a child pytest that sees 8 host devices.

XLA fixes the host device count when the backend starts, so a test file that needs a mesh runs itself again in
a child process with `--xla_force_host_platform_device_count`; the child sees `CHILD` true and collects the
mesh tests instead of the launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = os.environ.get("PAGED_JAX_MESH_CHILD") == "1"
NUM_DEVICES = 8


def run_mesh_child(test_file: str) -> None:
    """Run `test_file` in a child pytest with NUM_DEVICES CPU devices; fail with its output if it fails."""
    env = {
        **os.environ,
        "PAGED_JAX_MESH_CHILD": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NUM_DEVICES}",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]

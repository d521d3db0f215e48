"""Compile for an H200 (sm_90a) on a machine without a GPU, and read back what each kernel compiled to.

With ``jax-cuda13-plugin``, ``jax-cuda13-pjrt`` and ``nvidia-cuda-nvcc`` installed (``.venv-gpu``: ``make
gpu-check``), ``jax.experimental.topologies.get_topology_desc("h200", "cuda", target_config=...)`` gives
compile-only H200 devices; ``jit(...).lower(...).compile()`` against them runs XLA's GPU pipeline, the Triton
compiler and the wheel's ``ptxas -arch=sm_90a`` to SASS. Nothing runs. ``JAX_PLATFORMS=cpu`` must be set before
jax is imported (the plugin would look for a GPU otherwise).

:class:`H200Compiler` puts a ``ptxas`` wrapper first in XLA's CUDA directory (``jax._src.lib.cuda_path``, which
jax passes as ``--xla_gpu_cuda_data_dir``): it keeps each PTX input and the ``ptxas -v`` report, then runs the
real ptxas. XLA's dump (``--xla_dump_to``) gives each kernel's launch (grid, threads, shared memory: the
``thunk_sequence.txt`` lines). :meth:`H200Compiler.compile` returns the compiled executable and one
:class:`KernelReport` per kernel: registers, spill bytes, shared memory, whether loads are asynchronous copies
(``cp.async``: LDGSTS; ``cp.async.bulk``: TMA) and which MMA it issues (``wgmma``: Hopper warpgroup MMA;
``mma.sync``: the Ampere-style MMA). Register spills are made fatal
(``--xla_gpu_fail_ptx_compilation_on_register_spilling``), and XLA fails a kernel over the target's shared
memory per block (``RESOURCE_EXHAUSTED: Shared memory size limit exceeded``), so both fail the compile itself.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

import jax
import numpy as np

TARGET_CONFIG = pathlib.Path(__file__).with_name("h200.txtpb")  # XLA's H100 description with H200 memory

# The wrapper: the PTX input and the -v report kept per call, then the real ptxas. XLA runs ptxas from several
# compile threads at once, so each call takes a name of its own from mktemp (numbering calls by counting the
# logs so far gave two concurrent calls one name: one kernel's report was lost, under load only).
_PTXAS_WRAPPER = """#!/bin/sh
n=$(mktemp "$PAGED_JAX_PTX_DIR/call.XXXXXXXX")
for a in "$@"; do case "$a" in -*) ;; *) [ -f "$a" ] && cp "$a" "$n.ptx";; esac; done
"$PAGED_JAX_REAL_PTXAS" -v "$@" 2> "$n.log"
rc=$?
cat "$n.log" >&2
exit $rc
"""


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What one GPU kernel compiled to (from its PTX, ``ptxas -v`` and XLA's launch)."""

    name: str
    registers: int
    spill_bytes: int  # stores + loads
    shared_memory: int  # bytes per block (dynamic + static), from XLA's launch
    grid: tuple[int, int, int]
    threads: int
    async_copies: bool  # cp.async (LDGSTS) or cp.async.bulk (TMA) in the PTX
    tma: bool
    mma: str  # "wgmma", "mma.sync" or "none"
    clean_kv_loop: bool  # a pipelined MMA loop without a 16-bit select: its K/V go from cp.async to the MMA

    def row(self) -> str:
        grid = "x".join(map(str, self.grid))
        copy = "tma" if self.tma else ("cp.async" if self.async_copies else "sync")
        return (
            f"{self.name:<44}{self.registers:>5}{self.spill_bytes:>7}{self.shared_memory / 1024:>9.1f}"
            f"{self.threads:>6}{grid:>13}  {copy:<9}{self.mma:<9}{'yes' if self.clean_kv_loop else 'no'}"
        )


HEADER = (
    f"{'kernel':<44}{'regs':>5}{'spill':>7}{'smem KiB':>9}{'thr':>6}{'grid':>13}  {'loads':<9}{'mma':<9}unmasked loop"
)

_ENTRY = re.compile(r"^\.(?:visible )?\.entry (\w+)\(", re.M)
_PTXAS_FN = re.compile(
    r"Function properties for (\w+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    r"\s+ptxas info\s+: Used (\d+) registers"
)
_LAUNCH = re.compile(
    r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes"
)


def h200_topology(num_gpus: int = 1):
    """Compile-only H200 devices (``1x1x{num_gpus}``: one host, NVLink) from :data:`TARGET_CONFIG`."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        "h200", "cuda", target_config=TARGET_CONFIG.read_text(), topology=f"1x1x{num_gpus}"
    )


def _real_ptxas() -> pathlib.Path:
    from jax._src import lib

    candidates = [pathlib.Path(p) / "bin" / "ptxas" for p in (lib.cuda_path,) if p]
    found = [c for c in candidates if c.exists()] or [pathlib.Path(p) for p in [shutil.which("ptxas")] if p]
    if not found:
        raise RuntimeError("no ptxas: install nvidia-cuda-nvcc (make .venv-gpu)")
    return found[0]


class H200Compiler:
    """Compiles jitted functions for H200 devices and reports each kernel (see the module docstring)."""

    def __init__(self, num_gpus: int = 1):
        from jax._src import lib

        self.topology = h200_topology(num_gpus)
        self.devices = list(self.topology.devices)
        real = _real_ptxas()
        self._root = pathlib.Path(tempfile.mkdtemp(prefix="paged_jax_h200_"))
        cuda = self._root / "cuda"
        (cuda / "bin").mkdir(parents=True)
        wrapper = cuda / "bin" / "ptxas"
        wrapper.write_text(_PTXAS_WRAPPER)
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        real_cuda = real.parent.parent
        for name in ("nvlink", "fatbinary", "cuobjdump"):
            if (real_cuda / "bin" / name).exists():
                (cuda / "bin" / name).symlink_to(real_cuda / "bin" / name)
        for name in ("nvvm", "lib", "include"):
            if (real_cuda / name).exists():
                (cuda / name).symlink_to(real_cuda / name)
        os.environ["PAGED_JAX_REAL_PTXAS"] = str(real)
        lib.cuda_path = str(cuda)
        self._count = 0

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)

    def compile(self, fn: Callable | None, *args, mesh: jax.sharding.Mesh | None = None, lower=None, options=()):
        """``(compiled, reports)``: ``jax.jit(fn).lower(*args).compile()`` for the H200 (or ``lower()``'s
        lowering, e.g. an engine step's job, run under ``mesh``, with the job's compiler ``options`` pairs), with
        one :class:`KernelReport` per distinct kernel that ptxas compiled."""
        self._count += 1
        work = self._root / f"c{self._count}"
        ptx_dir, dump = work / "ptx", work / "dump"
        ptx_dir.mkdir(parents=True)
        os.environ["PAGED_JAX_PTX_DIR"] = str(ptx_dir)
        mesh = mesh or jax.sharding.Mesh(np.array(self.devices[:1]), ("x",))
        try:
            with jax.set_mesh(mesh):
                if lower is None:
                    assert fn is not None, "compile() needs fn or lower"
                    lowered = jax.jit(fn).lower(*args)
                else:
                    lowered = lower()
                compiled = lowered.compile(
                    {
                        **dict(options),
                        "xla_gpu_fail_ptx_compilation_on_register_spilling": True,
                        "xla_dump_to": str(dump),
                    }
                )
        except Exception as e:
            spilled = [r for r in _reports(ptx_dir, dump) if r.spill_bytes > 0]
            if spilled:  # name the kernels ptxas spilled in (the compiler's error does not)
                e.add_note("spilled: " + ", ".join(f"{r.name} ({r.spill_bytes} bytes)" for r in spilled))
            raise
        finally:
            if os.environ.get("PAGED_JAX_KEEP_PTX"):  # debugging: keep every PTX and ptxas report
                shutil.copytree(ptx_dir, os.environ["PAGED_JAX_KEEP_PTX"] + f"/c{self._count}", dirs_exist_ok=True)
        reports = _reports(ptx_dir, dump)
        shutil.rmtree(work, ignore_errors=True)
        return compiled, reports


def _reports(ptx_dir: pathlib.Path, dump: pathlib.Path) -> list[KernelReport]:
    ptx = [p.read_text(errors="replace") for p in sorted(ptx_dir.glob("*.ptx"))]
    logs = [p.read_text(errors="replace") for p in sorted(ptx_dir.glob("*.log"))]
    seqs = [p.read_text(errors="replace") for p in dump.glob("*thunk_sequence.txt")]
    return kernel_reports(ptx, logs, seqs)


def kernel_reports(ptx: list[str], ptxas_logs: list[str], thunk_sequences: list[str]) -> list[KernelReport]:
    """One :class:`KernelReport` per ``.entry`` of the PTX texts, with its registers and spills from the ``ptxas
    -v`` reports and its launch from XLA's thunk sequences (unknown values are -1)."""
    entries: dict[str, str] = {}
    for text in ptx:
        for name in _ENTRY.findall(text):
            entries[name] = _entry_body(text, name)
    props: dict[str, tuple[int, int]] = {}
    for log in ptxas_logs:
        for m in _PTXAS_FN.finditer(log):
            props[m[1]] = (int(m[5]), int(m[3]) + int(m[4]))
    launches: dict[str, tuple[tuple[int, int, int], int, int]] = {}
    for seq in thunk_sequences:
        for m in _LAUNCH.finditer(seq):
            grid = (int(m[2]), int(m[3]), int(m[4]))
            launches[m[1]] = (grid, int(m[5]) * int(m[6]) * int(m[7]), int(m[8]))
    reports = []
    for name, body in entries.items():
        regs, spills = props.get(name, (-1, -1))
        grid, threads, smem = launches.get(name, ((0, 0, 0), 0, -1))
        tma = "cp.async.bulk" in body
        mma = "wgmma" if "wgmma.mma_async" in body else ("mma.sync" if "mma.sync" in body else "none")
        async_copies = tma or "cp.async." in body
        reports.append(KernelReport(name, regs, spills, smem, grid, threads, async_copies, tma, mma, clean_loop(body)))
    return reports


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.M)
_MMA = ("wgmma.mma_async", "mma.sync")


def loop_bodies(body: str) -> list[str]:
    """The PTX of each loop of an entry: from a label to the last branch back to it."""
    loops = []
    for m in _LABEL.finditer(body):
        back = body.rfind(f"bra.uni \t{m[1]};"), body.rfind(f" bra \t{m[1]};")
        end = max(back)
        if end > m.end():
            loops.append(body[m.end() : end])
    return loops


def clean_loop(body: str) -> bool:
    """Whether some loop waits on async copies, issues MMAs and selects no 16-bit values (a V zeroed by a
    select between load and dot would show as ``selp.b16`` and a shared-memory round trip)."""
    return any(
        "cp.async.wait_group" in loop and any(k in loop for k in _MMA) and "selp.b16" not in loop
        for loop in loop_bodies(body)
    )


def _entry_body(text: str, name: str) -> str:
    """The PTX of one ``.entry`` (up to the next entry)."""
    starts = [(m.start(), m[1]) for m in _ENTRY.finditer(text)]
    for i, (start, entry) in enumerate(starts):
        if entry == name:
            return text[start : starts[i + 1][0] if i + 1 < len(starts) else len(text)]
    return ""

"""XLA settings: which flags a process ran with (logged so that a benchmark says what it measured), and
the compiler options the forward step is compiled with (oneDNN dots on CPU; cuBLAS dots for a scanned GPU step).

No process-wide flag is set. One per-executable option is: on a CPU with AMX tiles (``amx_bf16`` in
``/proc/cpuinfo``) a bfloat16 model's forward step is compiled with XLA's oneDNN dot fusion
(``xla_cpu_use_onednn`` + fusion type ``dot``), which runs the weight matmuls on AMX tiles; every other
executable, and (unless asked for, below) every float32 or non-CPU one, keeps XLA's default (YNNPACK) dots. Passed to
``Lowered.compile(compiler_options=...)``, so only the forward executables see it, and it is part of their key.
oneDNN's fused dot takes one dtype in and out: a bfloat16 x bfloat16 -> float32 dot would be widened to
float32 (the whole weight converted on every call), so the LM head rounds its float32-accumulated logits to
bfloat16 under this option (what transformers' bfloat16 LM head returns), and they are widened after. Models
with int8/fp8 weights (their dequantizing dots accumulate in float32) keep XLA's dots.
Only steps of at least ``ONEDNN_MIN_TOKENS`` tokens (the token bucket) use it: with fewer rows oneDNN's dots
were slower than XLA's (a decode step of 8 sequences), from 32 rows on faster (docs/benchmarks/cpu_step.md).
``PAGED_JAX_ONEDNN``: ``auto`` (default: as above), ``1`` (also without AMX, and for float32 models too),
``0`` (off). Float32 forward steps take oneDNN's AVX-512/AVX2 float32 GEMMs only under ``1``: they cost less CPU
than XLA's default dots on the peers' 56M model, but XLA:CPU cannot serialize a oneDNN fusion, so under
``auto`` a float32 model's warm start keeps loading every step from the executable store.
Figures: docs/benchmarks/cpu_step.md.

GPU: a scanned decoder's forward step (`paged_jax.model.scan`) with float weights is compiled with XLA's Triton
GEMM fusions off (``xla_gpu_enable_triton_gemm=false``, ``SCANNED_GPU_OPTIONS``), so its dots are cuBLAS calls.
XLA:GPU does not fuse the dynamic-slice of a stacked weight into a Triton GEMM: every layer's slice of every
weight was copied out before its dot (Llama-3.1-8B: 417 MiB of temporaries, the whole 15 GiB of weights
written and read again per step), while a cuBLAS call reads the slice in place (XLA's dynamic-slice fusion).
Quantized weights keep the Triton GEMMs, which fuse the dequantizing convert.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import jax.numpy as jnp

log = logging.getLogger(__name__)

ONEDNN_ENV = "PAGED_JAX_ONEDNN"
ONEDNN_MODES = ("auto", "1", "0")
ONEDNN_MIN_TOKENS = 32  # the smallest token bucket whose forward step uses oneDNN dots
# XLA's oneDNN library fusion of dots (a repeated enum option: its value is the enum's full name).
ONEDNN_DOT_OPTIONS: dict[str, object] = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}


def log_settings() -> str:
    """The XLA flags in effect (from `XLA_FLAGS`) and the oneDNN mode, printed and logged."""
    line = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} {ONEDNN_ENV}={onednn_mode()}"
    log.info(line)
    print(line)
    return line


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX tiles with bfloat16 (Linux's `amx_tile` and `amx_bf16` flags)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {"amx_tile", "amx_bf16"} <= flags
    return False


def onednn_mode() -> str:
    """``PAGED_JAX_ONEDNN`` (``auto`` when unset); anything else is an error naming the variable."""
    mode = os.environ.get(ONEDNN_ENV, "auto").strip().lower() or "auto"
    if mode not in ONEDNN_MODES:
        raise ValueError(f"{ONEDNN_ENV}: must be one of {ONEDNN_MODES}, got {mode!r}")
    return mode


def use_onednn_dots(dtype, platform: str, mode: str | None = None, amx: bool | None = None) -> bool:
    """Whether a forward step of a `dtype` model on `platform` is compiled with oneDNN dots: CPU only, by
    `mode` (default: the environment's): ``1`` for bfloat16 and float32 models, ``auto`` for bfloat16 ones
    where `amx` (default: this CPU's) holds."""
    dtype = jnp.dtype(dtype)
    if platform != "cpu" or dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        return False
    mode = onednn_mode() if mode is None else mode
    if mode == "auto":
        if dtype != jnp.dtype(jnp.bfloat16):
            return False
        return cpu_has_amx() if amx is None else amx
    return mode == "1"


SCANNED_GPU_OPTIONS: dict[str, object] = {"xla_gpu_enable_triton_gemm": False}


def forward_compiler_options(onednn: bool, scanned_gpu: bool = False) -> tuple[tuple[str, object], ...]:
    """The forward step's compiler options, as sorted (name, value) pairs (hashable: part of the key).
    `scanned_gpu`: a scanned GPU step with float weights (module docstring)."""
    options = {**(ONEDNN_DOT_OPTIONS if onednn else {}), **(SCANNED_GPU_OPTIONS if scanned_gpu else {})}
    return tuple(sorted(options.items()))

"""The GPU kernel's Triton IR for an H200, on any machine: what the tests and compile checks read.

:func:`triton_modules` cross-lowers a function for CUDA against an abstract H200 (``jax.export``, no GPU and no
CUDA plugin needed) and returns the Triton module (``tt`` dialect text) of every Pallas call in it, in lowering
order, by observing jax's own lowering (the module is built by jax; only its text is kept). Arguments are
``jax.ShapeDtypeStruct``s, so real sizes (a multi-GiB page array) cost nothing. :func:`pointer_offsets` reads
the element type and offset width of every pointer addition (``tt.addptr``) of a module: the proof that an
array of more than 2^31 elements is addressed with 64-bit offsets (:mod:`pallas_kernels.gpu.offsets`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import jax
from jax import export
from jax._src.pallas.triton import lowering as _triton_lowering
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas call's Triton module: its kernel name and its IR text."""

    name: str
    text: str


def triton_modules(fn: Callable, *args) -> list[TritonModule]:
    """Lower ``jax.jit(fn)(*args)`` for CUDA on an abstract H200; the Triton modules of its Pallas calls."""
    seen: list[TritonModule] = []
    original = _triton_lowering.lower_jaxpr_to_triton_module

    def observe(jaxpr, grid_mapping, *rest, **kwargs):
        result = original(jaxpr, grid_mapping, *rest, **kwargs)
        asm = result.module.operation.get_asm()  # str (jaxlib's ir.pyi says object: binary=True gives bytes)
        assert isinstance(asm, str)
        seen.append(TritonModule(jaxpr.debug_info.func_name, asm))
        return result

    _triton_lowering.lower_jaxpr_to_triton_module = observe
    try:
        with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
            export.export(
                jax.jit(fn),
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)],
            )(*args)
    finally:
        _triton_lowering.lower_jaxpr_to_triton_module = original
    return seen


# %x = tt.addptr %p, %o : tensor<16x128x!tt.ptr<i8>>, tensor<16x128xi64>   (or scalar !tt.ptr<f32>, i32)
_ADDPTR = re.compile(
    r"tt\.addptr [^:\n]*:\s*(?:tensor<[^!>]*)?!tt\.ptr<(?P<elem>[\w]+)>>?,\s*(?:tensor<[\dx]*x)?i(?P<bits>\d+)"
)


def pointer_offsets(text: str) -> set[tuple[str, int]]:
    """``{(element type, offset bits)}`` over every ``tt.addptr`` of a Triton module's text."""
    return {(m["elem"], int(m["bits"])) for m in _ADDPTR.finditer(text)}

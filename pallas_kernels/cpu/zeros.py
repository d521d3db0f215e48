"""A zeroed array on XLA:CPU that costs no memory until it is written: the CPU KV cache's allocation.

Why: ``jnp.zeros`` on CPU writes every byte, so a multi-GiB page array costs seconds of page faults before the
first step, and its whole size in resident memory, though most pages are written much later or never. The
FFI handler ``ZeroPages`` (``cpu/zero_pages.h``, in the CPU kernel's library) returns the buffer XLA allocated
for its output with its whole pages replaced by a fresh anonymous mapping: exact zeros that the OS backs with
memory when a page is first written. The array is XLA's own, so a step that donates it updates it in place (a
buffer borrowed from numpy would be copied by the first donating step instead).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.cpu import paged


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype: jax.typing.DTypeLike, target: str):
    return jax.jit(lambda: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype))())


def zeros(shape: tuple[int, ...], dtype: jax.typing.DTypeLike) -> jax.Array | None:
    """A zeroed `shape` array of `dtype` on the default (CPU) device, mapped lazily; None when the CPU kernel's
    library is not available (no compiler, or ``PAGED_JAX_CPU_KERNEL=0``): the caller then uses ``jnp.zeros``."""
    k = paged.kernel()
    if k is None or k.zeros_target is None:
        return None
    return _zeros_fn(tuple(shape), jax.numpy.dtype(dtype), k.zeros_target)()

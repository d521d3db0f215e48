"""Does a compiled engine step copy a KV page array? (the HLO scanner of the TPU and GPU compile checks)

The step donates its page arrays and updates them in place; a whole-array copy, transpose or relayout of one
moves the whole cache (used or not) every step. :func:`kv_copies` reads the compiled step's HLO text
(``compiled.as_text()``) and returns every instruction that produces an array of the per-chip KV shape (one
layer's pages, or a scanned decoder's stacked ones, ``paged_jax.model.scan``) other than in place: the allowed
producers are parameters, the in-place scatter (and fusions whose root is one), dynamic-update-slice,
custom calls (the attention kernels read the pages where they are), tuples,
get-tuple-element, bitcasts and optimization barriers. An asynchronous copy (XLA staging the array in another
memory space, e.g. a small cache placed in TPU VMEM) shows as its ``copy-done``. Tested on saved HLO text
(``tests/test_hlo_audit.py``).
"""

from __future__ import annotations

import numpy as np

HLO_DTYPE = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "s8", "float8_e4m3fn": "f8e4m3fn"}
_ALLOWED = (
    "parameter(",
    "scatter(",
    "get-tuple-element(",
    "tuple(",
    "bitcast(",
    "custom-call(",
    "dynamic-update-slice(",
    "opt-barrier(",
)
_IN_PLACE_FUSION = ("scatter", "dynamic-update-slice", "dynamic_update")


def hlo_shape(shape: tuple[int, ...], dtype) -> str:
    """The HLO spelling of an array type, e.g. ``bf16[2049,2,16,128]``."""
    return f"{HLO_DTYPE[np.dtype(dtype).name]}[{','.join(str(d) for d in shape)}]"


def kv_copies(hlo: str, local_kv_shape: tuple[int, ...], dtype) -> list[str]:
    """Instructions of ``hlo`` that produce a whole KV page array of ``local_kv_shape`` other than in place
    (module docstring), each as its first 200 characters."""
    shape = hlo_shape(local_kv_shape, dtype)
    bad = []
    for line in hlo.splitlines():
        line = line.strip()
        if "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        rhs = rhs.strip()
        if not rhs.startswith(shape):
            continue
        op = rhs[len(shape) :].split(" ", 2)
        opname = op[1] if len(op) > 1 else rhs
        if opname.startswith(_ALLOWED):
            continue
        if opname.startswith("fusion(") and any(k in lhs for k in _IN_PLACE_FUSION):
            continue  # an in-place scatter fusion (its output aliases the donated input)
        bad.append(line[:200])
    return bad

"""Does a compiled engine step copy a KV page array? (the HLO scanner of the TPU and GPU compile checks)

The step donates its page arrays and updates them in place; a whole-array copy, transpose or relayout of one
moves the whole cache (used or not) every step. :func:`kv_copies` reads the compiled step's HLO text
(``compiled.as_text()``) and returns every instruction that produces an array of the per-chip KV shape (one
layer's pages, or a scanned decoder's stacked ones, ``paged_jax.model.scan``) other than in place: the allowed
producers are parameters, the in-place scatter (and fusions whose root is one), dynamic-update-slice,
custom calls (the attention kernels read the pages where they are), tuples,
get-tuple-element, bitcasts and optimization barriers. An asynchronous copy (XLA staging the array in another
memory space, e.g. a small cache placed in TPU VMEM) shows as its ``copy-done``, a sliced one as the
``ConcatBitcast`` custom call that reassembles it. Quantized pages' scale arrays (``f32[pages, row]``,
``pallas_kernels.kv_quant``) are checked the same way (:func:`cache_copies`): a narrow row once made XLA:TPU
relayout every layer's whole scale array each step. Tested on saved HLO text (``tests/worker/test_hlo_audit.py``).

:func:`weight_copies` measures the same for the weights: bytes of per-layer weight arrays a step materialises
(a scanned decoder's per-layer slice of a stacked weight copied out before its dot), reported by the TPU audit
and checked on the CPU decode step; :func:`with_matrix_forms` adds the 2-D forms a slice takes on its way into
a dot (XLA:CPU copies a slice already reshaped to the dot's matrix).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

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
# XLA:TPU's sliced prefetch: the array copied into VMEM in slices and reassembled by this custom call.
_SLICED_PREFETCH = 'custom_call_target="ConcatBitcast"'


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
        if opname.startswith(_ALLOWED) and _SLICED_PREFETCH not in rhs:
            continue
        if opname.startswith("fusion(") and any(k in lhs for k in _IN_PLACE_FUSION):
            continue  # an in-place scatter fusion (its output aliases the donated input)
        bad.append(line[:200])
    return bad


def cache_copies(hlo: str, arrays: Sequence[tuple[tuple[int, ...], object]]) -> list[str]:
    """:func:`kv_copies` of every array of a layer's cache (``(shape, dtype)`` per array: the pages, and the
    scales of quantized pages)."""
    return [line for shape, dtype in arrays for line in kv_copies(hlo, shape, dtype)]


_WEIGHT_ALLOWED = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "opt-barrier(")
_MIN_WEIGHT_BYTES = 256 * 1024  # norms and biases are too small to matter (and their shapes collide)
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_WHILE = re.compile(r" while\(.*?body=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]\{([^}]*)\}")
_TUPLE_ELEMENT = re.compile(r"(\w+)\[([\d,]*)\]\{([^}]*)\}")


@dataclass(frozen=True, slots=True)
class WeightCopies:
    """Per-layer weight arrays a compiled step materialises every step (a scanned decoder's dynamic-slice of
    a stacked weight into a buffer of its own, or a relayout of a per-layer weight) instead of its dots
    reading the parameter in place. Bytes are per step: an instruction in a while body counts once per trip."""

    hbm_bytes: int  # copies written to HBM: read, written and read again (decode weight traffic x 3)
    vmem_bytes: int  # slices staged whole in VMEM (memory space 1): one read, like the dot's own window
    lines: list[str]  # the instructions, first 200 characters each


def weight_copies(
    hlo: str, layer_shapes: list[tuple[tuple[int, ...], DTypeLike]], num_layers: int, tokens: int | None = None
) -> WeightCopies:
    """The per-layer weight copies (:class:`WeightCopies`) of ``hlo`` for weights of ``layer_shapes`` (one
    layer's ``(shape, dtype)`` per weight, per device), also matched with a leading 1 (a scan's slice) and
    with a leading ``num_layers`` (a relayout of a whole stacked weight), and as elements of a multi-output
    fusion's tuple (XLA:GPU slices several layers of a scan step in one). Only instructions of the entry
    computation and of while bodies count (fused computations are the fusions' insides, read in place); one
    in a while body counts once per trip (its known trip count, else ``num_layers``: XLA:TPU does not
    annotate it). ``tokens`` (the step's token count T): a weight whose first axis is T is matched only in
    its stacked forms, since as itself its shape is also an activation's (tiny's down_proj [512, 256] and the
    [T, H] hidden states of a 512-token step, which XLA:TPU relays out between fusions)."""
    itemsize = {HLO_DTYPE[np.dtype(dt).name]: np.dtype(dt).itemsize for _, dt in layer_shapes}
    wanted = set()
    for shape, dt in layer_shapes:
        if int(np.prod(shape)) * np.dtype(dt).itemsize >= _MIN_WEIGHT_BYTES:
            leads = ((1,), (num_layers,)) if shape[:1] == (tokens,) else ((), (1,), (num_layers,))
            wanted |= {hlo_shape(lead + shape, dt) for lead in leads}
    trips = {}  # while body -> trip count
    for line in hlo.splitlines():
        if (m := _WHILE.search(line)) is not None:
            t = _TRIPS.search(line)
            trips[m.group(1)] = int(t.group(1)) if t else num_layers
    hbm = vmem = 0
    lines, current = [], None
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)) is not None:
            current = "ENTRY" if line.startswith("ENTRY") else m.group(1)
            continue
        if current != "ENTRY" and current not in trips or "=" not in line:
            continue
        rhs = line.split("=", 1)[1].strip()
        if rhs.startswith("("):  # a tuple: only a multi-output fusion's elements are buffers of its own
            types, _, op = rhs[1:].partition(") ")
            arrays = list(_TUPLE_ELEMENT.finditer(types)) if op.startswith("fusion(") else []
        else:
            a = _ARRAY.match(rhs)
            arrays, op = ([a], rhs[a.end() :].strip()) if a is not None else ([], "")
        arrays = [a for a in arrays if f"{a.group(1)}[{a.group(2)}]" in wanted]
        if not arrays or op.startswith(_WEIGHT_ALLOWED):
            continue
        for a in arrays:
            if op.startswith("copy-done(") and "S(1)" in a.group(3):
                continue  # XLA's prefetch of a weight into VMEM (how every dot's operand arrives)
            size = int(np.prod([int(d) for d in a.group(2).split(",")])) * itemsize[a.group(1)]
            size *= trips.get(current, 1)
            if "S(1)" in a.group(3):
                vmem += size
            else:
                hbm += size
        lines.append(line.strip()[:200])
    return WeightCopies(hbm, vmem, lines)


def with_matrix_forms(layer_shapes: list[tuple[tuple[int, ...], DTypeLike]]) -> list[tuple[tuple[int, ...], DTypeLike]]:
    """``layer_shapes`` and every 2-D collapse of each (``[a * b, c * d]`` of ``[a, b, c, d]`` at each split):
    the matrix a dot reads a weight as, the shape XLA:CPU gives a layer's slice when it copies it out of a
    stacked weight (``qkv_proj`` [H, Hkv, G + 2, D] as [H, Hkv * (G + 2) * D], ``o_proj`` [Hq, D, H] as
    [Hq * D, H]), for :func:`weight_copies`."""
    out = list(layer_shapes)
    for shape, dt in layer_shapes:
        for k in range(1, len(shape)):
            form = ((int(np.prod(shape[:k])), int(np.prod(shape[k:]))), dt)
            if len(shape) > 2 and form not in out:
                out.append(form)
    return out

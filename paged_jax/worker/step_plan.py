"""One step's device work as host arrays (`StepPlan`), and its bytes on the wire (`encode_plan`, `decode_plan`).

The runner splits a step in two: `ModelRunner.plan_forward` turns the scheduler's output into a `StepPlan` (numpy
only: page copies padded to their bucket, the token and sequence buckets, the forward step's inputs, the sampler's,
the prompt-logprob and pooling rows), and `ModelRunner.run_plan` dispatches it. Multi-host serving
(`paged_jax.engine.multihost`) sends each plan from process 0 to every other process, which runs the same plan on
its own runner: the same executables with the same operands, so the step runs once over the global mesh.

The wire format is self-describing and never executable (no pickle): a 4-byte big-endian length, a JSON header
(the plan's structure, each array's dtype and shape) and the arrays' raw bytes, concatenated. Only the record types
named in `_TYPES` decode.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paged_jax.kv_cache.state_pool import StateCopy
from paged_jax.model.linear_state import StateMeta
from paged_jax.worker.pooling import PoolRows
from paged_jax.worker.prompt_logprobs import PromptRows
from paged_jax.worker.sampler import SamplingMeta
from paged_jax.worker.spec_verify import VerifyRows
from paged_jax.worker.step_inputs import SamplerFlags, SamplingInputs, StepInputs


@dataclass(slots=True)
class CopyChunk:
    """One dispatch of the page-copy executable: `src[i]` -> `dst[i]`, padded with null-page self copies to the
    copy bucket (`len(src)`)."""

    src: np.ndarray  # [n] i32
    dst: np.ndarray  # [n] i32


@dataclass(slots=True)
class StepPlan:
    """Everything one step dispatches, decided on the host (`ModelRunner.plan_forward`)."""

    copies: list[CopyChunk]  # copy-on-write chunks, before the forward step
    t: int  # the token bucket
    s: int  # the sequence bucket
    flags: SamplerFlags | None  # the compiled sampler variant the shapes resolved to (None: the rows' own)
    step: StepInputs
    has_prev: bool  # the step was launched with the previous step's samples on the device (the lookahead)
    sampling: SamplingInputs | None  # None: a greedy draft step (`ModelRunner.launch_greedy`)
    verify: VerifyRows | None = None
    prompt: PromptRows | None = None
    pool: PoolRows | None = None
    bitmask: np.ndarray | None = field(default=None)  # [R, ceil(V / 32)] i32 structured-output rows (sampling)
    state: StateMeta | None = None  # a linear-attention hybrid's state rows (`paged_jax.worker.linear_state`)
    state_restores: list[StateCopy] = field(default_factory=list)  # copied before the forward step
    state_copies: list[StateCopy] = field(default_factory=list)  # forks and snapshots, after the forward step


_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        CopyChunk,
        StepPlan,
        StepInputs,
        SamplingInputs,
        SamplingMeta,
        SamplerFlags,
        VerifyRows,
        PromptRows,
        StateMeta,
        StateCopy,
    )
}
_TYPES[PoolRows.__name__] = PoolRows


def _encode(obj: Any, arrays: list[np.ndarray]) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        arrays.append(np.ascontiguousarray(obj))
        return {"a": len(arrays) - 1}
    name = type(obj).__name__
    if _TYPES.get(name) is type(obj):
        if dataclasses.is_dataclass(obj):
            values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        else:  # a NamedTuple
            assert isinstance(obj, tuple)
            values = list(obj)
        return {"t": name, "f": [_encode(v, arrays) for v in values]}
    if isinstance(obj, list | tuple):
        return {"l": [_encode(v, arrays) for v in obj]}
    raise TypeError(f"a step plan cannot carry a {type(obj).__name__}")


def encode_plan(plan: StepPlan) -> bytes:
    """The bytes of `plan` (see the module docstring for the layout)."""
    arrays: list[np.ndarray] = []
    tree = _encode(plan, arrays)
    header = json.dumps(
        {"tree": tree, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}, separators=(",", ":")
    ).encode()
    return b"".join([struct.pack(">I", len(header)), header, *(a.tobytes() for a in arrays)])


def _decode(node: Any, arrays: list[np.ndarray]) -> Any:
    if not isinstance(node, dict):
        return node
    if "a" in node:
        return arrays[node["a"]]
    if "l" in node:
        return [_decode(v, arrays) for v in node["l"]]
    cls = _TYPES.get(node.get("t", ""))
    if cls is None:
        raise ValueError(f"step plan: unknown record type {node.get('t')!r}")
    return cls(*(_decode(v, arrays) for v in node["f"]))


def decode_plan(data: bytes) -> StepPlan:
    """The `StepPlan` of `encode_plan`'s bytes; a ValueError names what is malformed."""
    if len(data) < 4:
        raise ValueError("step plan: shorter than its length prefix")
    (n,) = struct.unpack(">I", data[:4])
    header = json.loads(data[4 : 4 + n])
    arrays, off = [], 4 + n
    for dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        size = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        if off + size > len(data):
            raise ValueError("step plan: truncated array data")
        arrays.append(np.frombuffer(data, dt, count=size // dt.itemsize, offset=off).reshape(shape))
        off += size
    if off != len(data):
        raise ValueError(f"step plan: {len(data) - off} trailing bytes")
    plan = _decode(header["tree"], arrays)
    if not isinstance(plan, StepPlan):
        raise ValueError("step plan: the message is not a StepPlan")
    return plan


__all__ = ["CopyChunk", "StepPlan", "decode_plan", "encode_plan"]

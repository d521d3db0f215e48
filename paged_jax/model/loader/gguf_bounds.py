"""A GGUF file's header (metadata and tensor infos), read with every count bounded by the bytes left.

gguf-py's `GGUFReader` believes the file: a key/value array that claims 2^62 elements makes it loop
(appending an empty slice per element) until memory runs out, and a tensor or key/value count larger
than the file ends in a raw `IndexError`; it is also slow on large vocabularies (`read_header`).
`read_header` walks the raw bytes once, returning the values, and refuses with a `GGUFError` naming
the key or tensor as soon as a count, a string length or a tensor's data reaches past the end of the file.
Its work is bounded by the file size: every element it steps over consumes at least one byte, and an array
whose count times its smallest element size is larger than the bytes left is refused before its first element
is read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np


class GGUFError(ValueError):
    """A GGUF file this runtime cannot use; the message names the key or tensor."""


# GGUFValueType codes (the GGUF spec): fixed-size scalars, then STRING = 8 and ARRAY = 9.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _U32 = 8, 9, 4
_MIN_STRING_BYTES = 8  # the u64 length of an empty string
_MIN_ARRAY_BYTES = 12  # item type u32 + count u64 of an empty array
_MAX_ARRAY_NESTING = 4  # arrays of arrays are legal; deeper nesting is no real model's metadata
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32


ByteOrder = Literal["<", ">"]  # struct's (and numpy's) little / big endian


@dataclass(slots=True)
class _Cursor:
    """A read position in the file's bytes; every read is checked against the end."""

    data: memoryview
    order: ByteOrder
    pos: int = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, n: int, what: str) -> int:
        """Step over `n` bytes, returning where they start."""
        if n < 0 or n > self.left:
            raise GGUFError(f"{what}: needs {n} bytes at offset {self.pos}, the file has {self.left} left")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        start = self.skip(size, what)
        return struct.unpack_from(self.order + fmt, self.data, start)[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"{what} (string length)")
        start = self.skip(n, what)
        try:
            return bytes(self.data[start : start + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what}: not UTF-8 ({e})") from None


def _min_bytes(vtype: int) -> int:
    if vtype in _SCALAR_BYTES:
        return _SCALAR_BYTES[vtype]
    return _MIN_STRING_BYTES if vtype == _STRING else _MIN_ARRAY_BYTES


def _scalar_dtype(vtype: int, order: ByteOrder) -> np.dtype:
    return np.dtype(_SCALAR_NUMPY[vtype]).newbyteorder(order)


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """One metadata value of type `vtype` as a plain Python value (int, float, bool, str, or a list of them:
    what gguf-py's `ReaderField.contents()` gives, read straight from the bytes)."""
    if vtype in _SCALAR_BYTES:
        start = cur.skip(_SCALAR_BYTES[vtype], what)
        return np.frombuffer(cur.data, _scalar_dtype(vtype, cur.order), 1, start)[0].item()
    if vtype == _STRING:
        return cur.string(what)
    if vtype != _ARRAY:
        raise GGUFError(f"{what}: unknown value type {vtype}")
    if depth >= _MAX_ARRAY_NESTING:
        raise GGUFError(f"{what}: arrays nested deeper than {_MAX_ARRAY_NESTING}")
    itype = cur.unpack("I", f"{what} (array item type)")
    count = cur.unpack("Q", f"{what} (array length)")
    if itype not in _SCALAR_BYTES and itype not in (_STRING, _ARRAY):
        raise GGUFError(f"{what}: unknown array item type {itype}")
    if count * _min_bytes(itype) > cur.left:
        raise GGUFError(f"{what}: array of {count} elements, but only {cur.left} bytes are left in the file")
    if itype in _SCALAR_BYTES:  # one numpy read of the whole array
        start = cur.skip(count * _SCALAR_BYTES[itype], what)
        return np.frombuffer(cur.data, _scalar_dtype(itype, cur.order), count, start).tolist()
    if itype == _STRING:
        return [cur.string(f"{what}[{i}]") for i in range(count)]
    return [_read_value(cur, itype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_metadata(cur: _Cursor, kv_count: int) -> dict[str, Any]:
    """The key/values in file order."""
    if kv_count * (_MIN_STRING_BYTES + 4 + 1) > cur.left:
        raise GGUFError(f"GGUF.kv_count: {kv_count} key/values cannot fit in the {cur.left} bytes left")
    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise GGUFError(f"{key}: duplicate metadata key")
        vtype = cur.unpack("I", f"{key} (value type)")
        metadata[key] = _read_value(cur, vtype, key)
        if key == "general.alignment":
            value = metadata[key]
            if vtype != _U32 or value == 0 or value & (value - 1):
                raise GGUFError("general.alignment: must be a u32 power of two")
    return metadata


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies: `dims` in ggml order (ne0 first), `qtype` the ggml type code, `start` and
    `n_bytes` its extent in the file."""

    name: str
    dims: tuple[int, ...]
    qtype: int
    start: int
    n_bytes: int


def _read_tensor_infos(cur: _Cursor, tensor_count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if tensor_count * _MIN_TENSOR_INFO_BYTES > cur.left:
        raise GGUFError(f"GGUF.tensor_count: {tensor_count} tensors cannot fit in the {cur.left} bytes left")
    infos, names = [], set()
    for i in range(tensor_count):
        name = cur.string(f"tensor #{i} name")
        if name in names:
            raise GGUFError(f"{name}: duplicate tensor")
        names.add(name)
        n_dims = cur.unpack("I", f"{name} (n_dims)")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFError(f"{name}: {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        dims = tuple(cur.unpack("Q", f"{name} (dimension {d})") for d in range(n_dims))
        qtype = cur.unpack("I", f"{name} (type)")
        try:
            block, _ = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise GGUFError(f"{name}: unknown ggml type {qtype}") from None
        if dims[0] % block:
            raise GGUFError(f"{name}: first dimension {dims[0]} is not a multiple of the block size {block}")
        infos.append((name, dims, qtype, cur.unpack("Q", f"{name} (data offset)")))
    return infos


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """A GGUF file's header: `metadata` (plain Python values, file order), `tensors` (where each lies) and
    the byte `order` of its numbers ("<" or ">")."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    order: ByteOrder


def read_header(data: np.ndarray) -> GGUFHeader:
    """The header of the file `data` (the whole file as a flat uint8 array, e.g. its memory map); raises
    `GGUFError` unless every count, length and tensor extent in it lies inside the file.

    Why not `gguf.GGUFReader`: it builds a numpy view per metadata element (about 7 per vocabulary entry),
    ~50 s for a 50k-token vocabulary on a busy core; this walk reads each string once and each numeric array in
    one `np.frombuffer`, and is bounded by the file size (module docstring).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    view = memoryview(np.ascontiguousarray(data, dtype=np.uint8)).cast("B")
    cur = _Cursor(view, "<")
    if bytes(view[:4]) != b"GGUF":
        raise GGUFError("not a GGUF file (magic)")
    cur.skip(4, "magic")
    version = cur.unpack("I", "GGUF.version")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise GGUFError(f"GGUF.version: {version} (2 and 3 are supported)")
    tensor_count = cur.unpack("Q", "GGUF.tensor_count")
    kv_count = cur.unpack("Q", "GGUF.kv_count")
    metadata = _read_metadata(cur, kv_count)
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    infos = _read_tensor_infos(cur, tensor_count)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        n_bytes = int(np.prod(dims, dtype=object)) * type_bytes // block
        start = data_start + offset
        if start + n_bytes > len(view):
            raise GGUFError(
                f"{name}: data ends at byte {start + n_bytes}, past the end of the file ({len(view)} bytes);"
                " truncated or corrupt"
            )
        tensors.append(TensorInfo(name, dims, qtype, start, n_bytes))
    return GGUFHeader(metadata, tensors, cur.order)


__all__ = ["GGUFError", "GGUFHeader", "TensorInfo", "read_header"]

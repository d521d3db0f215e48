"""What is in a GGUF file: its metadata and its tensors, read through the memory map one at a time.

GGUF (llama.cpp's format) stores metadata key/values (architecture hyperparameters under
`{arch}.*`, the tokenizer under `tokenizer.*`) and tensors in ggml's order: a tensor of ggml shape
`[ne0, ne1]` is the numpy/HF array `[ne1, ne0]` = `[out, in]`. Quantized tensors are blocks of
bytes; `GGUFTensor.dequantize()` turns one into float32 with the `gguf` package's numpy
dequantizer, the same one transformers' GGUF loader and llama.cpp's own Python tools use, so the
values are exactly theirs. Nothing is dequantized until asked, and `GGUFTensor.raw` keeps the
quantized blocks (a memory-map view) for a future in-memory quantized path.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paged_jax.model.loader.gguf_bounds import GGUFError, TensorInfo, read_header

# The ggml types `dequantize` accepts: plain floats, the legacy block quants and the K-quants.
# (gguf-py also dequantizes the IQ/TQ/MXFP4 types; they are let through but untested here.)
TESTED_QUANT_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, not yet dequantized.

    `shape` is numpy order (`[out, in]` for a matrix, the reverse of ggml's `ne`); `raw` is the
    memory-mapped data: `[rows, bytes_per_row]` uint8 for block-quantized types, the array itself
    for float types.
    """

    name: str
    qtype: str  # ggml type name, e.g. "Q4_1"
    shape: tuple[int, ...]
    raw: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 `shape`, by gguf-py's reference dequantizer."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        try:
            values = dequantize(self.raw, GGMLQuantizationType[self.qtype])
        except NotImplementedError as e:
            raise GGUFError(f"{self.name}: ggml type {self.qtype} cannot be dequantized ({e})") from e
        values = np.asarray(values, dtype=np.float32)
        if values.size != int(np.prod(self.shape)):
            raise GGUFError(f"{self.name}: {values.size} values after dequantization, shape {self.shape}")
        return values.reshape(self.shape)


# ggml types stored as plain numpy arrays (the rest are blocks of bytes, `[rows, bytes_per_row]`), as gguf-py does.
_PLAIN_TYPES = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class GGUFFile:
    """An open GGUF file: `metadata` (plain Python values) and lazy `tensors()`.

    The file is memory-mapped and its header read by `gguf_bounds.read_header`; a tensor's bytes are read only
    when it is dequantized, so loading holds at most one dequantized tensor beyond the parameters built so far.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            self._data = np.memmap(self.path, mode="r")
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        try:
            header = read_header(self._data)
        except GGUFError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        self.metadata: dict[str, Any] = header.metadata
        self._infos = header.tensors
        self._order = header.order

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture"))

    def get(self, key: str, default: Any = ...) -> Any:
        """The value of metadata `key`; without `default`, a missing key raises `GGUFError`."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise GGUFError(f"{key}: missing from {self.path.name}")
        return default

    def tensor_names(self) -> list[str]:
        return [t.name for t in self._infos]

    def _tensor(self, info: TensorInfo) -> GGUFTensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.qtype).name
        shape = tuple(reversed(info.dims))
        raw = self._data[info.start : info.start + info.n_bytes]
        if qtype in _PLAIN_TYPES:
            raw = raw.view(np.dtype(_PLAIN_TYPES[qtype]).newbyteorder(self._order)).reshape(shape)
        else:
            raw = raw.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType(info.qtype)))
        return GGUFTensor(name=info.name, qtype=qtype, shape=shape, raw=raw)

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor in file order, as lazy `GGUFTensor`s."""
        for info in self._infos:
            yield self._tensor(info)

    def quant_types(self) -> dict[str, int]:
        """ggml type name -> number of tensors of that type (for `info` and error messages)."""
        from gguf import GGMLQuantizationType

        counts: dict[str, int] = {}
        for t in self._infos:
            name = GGMLQuantizationType(t.qtype).name
            counts[name] = counts.get(name, 0) + 1
        return counts


def is_gguf(path: str | Path) -> bool:
    """True for an existing file whose first four bytes are GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "TESTED_QUANT_TYPES", "is_gguf"]

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

from paged_jax.model.loader.gguf_bounds import GGUFError, check_layout

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


class GGUFFile:
    """An open GGUF file: `metadata` (plain Python values) and lazy `tensors()`.

    The file is memory-mapped by `gguf.GGUFReader`; a tensor's bytes are read only when it is
    dequantized, so loading holds at most one dequantized tensor beyond the parameters built so far.
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            data = np.memmap(self.path, mode="r")
        except (ValueError, OSError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        try:
            check_layout(data)
        except GGUFError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        try:
            self._reader = GGUFReader(str(self.path), "r")
        except (ValueError, OSError, KeyError, IndexError, OverflowError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue  # the header's own counts
            self.metadata[name] = field.contents()

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
        return [t.name for t in self._reader.tensors]

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor in file order, as lazy `GGUFTensor`s."""
        for t in self._reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            yield GGUFTensor(name=t.name, qtype=t.tensor_type.name, shape=shape, raw=t.data)

    def quant_types(self) -> dict[str, int]:
        """ggml type name -> number of tensors of that type (for `info` and error messages)."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts


def is_gguf(path: str | Path) -> bool:
    """True for an existing file whose first four bytes are GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "TESTED_QUANT_TYPES", "is_gguf"]

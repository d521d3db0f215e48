"""Hostile GGUF files: every count, length and extent the header claims is bounded by the bytes left in
the file, so a 100-byte file that claims 2^62 elements fails at once with a `GGUFError` naming the key
or tensor (gguf-py's reader alone loops until memory runs out or ends in a raw `IndexError`)."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from paged_jax.model.loader.gguf_file import GGUFError, GGUFFile

U32, STRING, ARRAY = 4, 8, 9


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_string(key: str, value: str) -> bytes:
    return _str(key) + struct.pack("<I", STRING) + _str(value)


def _header(tensor_count: int, kv_count: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count)


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    return path


def _open_quickly(path: Path) -> GGUFError:
    start = time.perf_counter()
    with pytest.raises(GGUFError) as info:
        GGUFFile(path)
    assert time.perf_counter() - start < 5.0
    return info.value


@pytest.mark.parametrize("count", [2**62, 1000])
def test_array_count_bomb(tmp_path: Path, count: int) -> None:
    # the 110-byte file: llama.block_count as an ARRAY of `count` uint32 with no elements behind it
    arch = _kv_string("general.architecture", "llama")
    bomb = _str("llama.block_count") + struct.pack("<IIQ", ARRAY, U32, count)
    path = _write(tmp_path, _header(0, 2) + arch + bomb)
    assert path.stat().st_size < 128
    assert "llama.block_count" in str(_open_quickly(path))


def test_array_of_strings_bomb(tmp_path: Path) -> None:
    bomb = _str("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, 2**40) + _str("a")
    assert "tokenizer.ggml.tokens" in str(_open_quickly(_write(tmp_path, _header(0, 1) + bomb)))


@pytest.mark.parametrize("field,counts", [("GGUF.kv_count", (0, 2**40)), ("GGUF.tensor_count", (2**40, 1))])
def test_header_count_bomb(tmp_path: Path, field: str, counts: tuple[int, int]) -> None:
    path = _write(tmp_path, _header(*counts) + _kv_string("general.architecture", "llama"))
    assert field in str(_open_quickly(path))


def test_string_length_past_the_end(tmp_path: Path) -> None:
    data = _header(0, 1) + _str("general.architecture") + struct.pack("<IQ", STRING, 2**63) + b"llama"
    assert "general.architecture" in str(_open_quickly(_write(tmp_path, data)))


def test_nested_arrays_refused(tmp_path: Path) -> None:
    nested = struct.pack("<II", ARRAY, ARRAY) + struct.pack("<QI", 1, ARRAY) * 200 + struct.pack("<Q", 0)
    data = _header(0, 1) + _str("general.deep") + nested
    assert "nested" in str(_open_quickly(_write(tmp_path, data)))


def _tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return _str(name) + struct.pack("<I", n) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", qtype, offset)


@pytest.mark.parametrize(
    "info,needle",
    [
        (_tensor_info("token_embd.weight", (4, 4), 0, 0), "past the end"),  # 64 bytes of data, none there
        (_tensor_info("token_embd.weight", (4, 4), 0, 2**60), "past the end"),
        (_tensor_info("token_embd.weight", (4,), 0, 0, n_dims=2**31), "dimensions"),
        (_tensor_info("token_embd.weight", (4, 4), 999, 0), "unknown ggml type"),
        (_tensor_info("token_embd.weight", (2**40, 2**40), 0, 0), "past the end"),
    ],
    ids=["no-data", "offset", "n_dims", "type", "huge-dims"],
)
def test_bogus_tensor_info(tmp_path: Path, info: bytes, needle: str) -> None:
    data = _header(1, 1) + _kv_string("general.architecture", "llama") + info
    data += b"\0" * (-len(data) % 32)
    err = _open_quickly(_write(tmp_path, data))
    assert "token_embd.weight" in str(err) and needle in str(err)


def test_truncated_real_file(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "ok.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((8, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    whole = (tmp_path / "ok.gguf").read_bytes()
    assert GGUFFile(tmp_path / "ok.gguf").get("llama.block_count") == 1  # the walker accepts a real file
    for cut in (len(whole) - 1, len(whole) // 2, 40, 20, 4, 0):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        _open_quickly(tmp_path / "cut.gguf")


def test_header_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    """Our header walk against gguf-py's `GGUFReader` on a file with every value type and several tensor types:
    the same metadata (values and Python types, file order) and the same tensor views (dtype, shape, bytes)."""
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
    for i, (value, vtype) in enumerate(
        [(7, "UINT8"), (-7, "INT8"), (700, "UINT16"), (-700, "INT16"), (70_000, "UINT32"), (-70_000, "INT32"),
         (1e-5, "FLOAT32"), (2**40, "UINT64"), (-(2**40), "INT64"), (1e-300, "FLOAT64"), (True, "BOOL"),
         ("Việt ✓", "STRING"), ([1, 2, 3], "ARRAY"), (["a", "", "ü"], "ARRAY"), ([0.5, -1.25], "ARRAY")]
    ):  # fmt: skip
        w.add_key_value(f"test.value{i}", value, gguf.GGUFValueType[vtype])
    w.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = GGUFFile(tmp_path / "all.gguf"), gguf.GGUFReader(str(tmp_path / "all.gguf"))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(want)
    assert [(v, type(v)) for v in ours.metadata.values()] == [(v, type(v)) for v in want.values()]
    for mine, ref in zip(ours.tensors(), theirs.tensors, strict=True):
        assert (mine.name, mine.qtype, mine.shape) == (ref.name, ref.tensor_type.name, tuple(reversed(ref.shape)))
        assert mine.raw.dtype == ref.data.dtype and mine.raw.shape == ref.data.shape
        np.testing.assert_array_equal(mine.raw, ref.data)
    assert ours.quant_types() == {"F32": 1, "F16": 1, "Q8_0": 1}

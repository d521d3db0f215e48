"""The disk tier's files (no device): a block written behind reads back bit for bit in a fresh tier (a restart);
a truncated, corrupt, foreign-fingerprint or renamed file is rejected, deleted and counted, never returned; the
directory stays under its size bound, least recently used first; an unwritable directory logs once, counts, and
leaves the tier answering misses."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from paged_jax.kv_cache import BlockHash, DiskTier
from paged_jax.kv_cache.disk_tier import SUFFIX, decode, encode

LAYOUT = [((2, 4, 8), np.dtype(np.int8)), ((2, 16), np.dtype(np.float32))]  # an int8 page and its scales


def block(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-128, 128, (2, 4, 8)).astype(np.int8), rng.standard_normal((2, 16)).astype(np.float32)]


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def tier(path, fp: str = "model-a", max_bytes: int = 1 << 20) -> DiskTier:
    t = DiskTier(path, fp, max_bytes)
    t.bind(LAYOUT)
    return t


def only_file(t: DiskTier):
    files = [p for p in t.dir.iterdir()]
    assert len(files) == 1 and files[0].suffix == SUFFIX  # no temporary file left behind
    return files[0]


def test_written_behind_and_read_back_after_a_restart(tmp_path):
    a = tier(tmp_path)
    a.put(key(1), block(1))
    a.flush()
    a.close()
    b = tier(tmp_path)  # a restart: the index is rebuilt from the directory
    assert key(1) in b and key(2) not in b
    got = b.take(key(1))
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(got, block(1), strict=True))
    assert b.stats().hits == 1 and b.stats().files == 1


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "foreign", "renamed"],
)
def test_a_bad_file_is_deleted_and_never_read(tmp_path, damage):
    a = tier(tmp_path)
    a.put(key(1), block(1))
    a.flush()
    path = only_file(a)
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        path.write_bytes(raw[:40] + bytes([raw[40] ^ 1]) + raw[41:])
    elif damage == "foreign":  # a whole, valid file of another fingerprint put where this one's belongs
        path.write_bytes(encode("model-b", key(1), block(1)))
    else:  # a whole, valid file of another block under this block's name
        path.write_bytes(encode("model-a", key(2), block(2)))
    b = tier(tmp_path)
    assert key(1) not in b
    assert not path.exists() and b.stats().rejected == 1 and b.stats().files == 0


def test_layout_and_fingerprint_are_checked_by_decode():
    raw = encode("fp", key(3), block(3))
    assert len(decode(raw, "fp", key(3), LAYOUT)) == 2
    with pytest.raises(ValueError, match="fingerprint"):
        decode(raw, "other", key(3), LAYOUT)
    with pytest.raises(ValueError, match="layout"):
        decode(raw, "fp", key(3), [((2, 4, 8), np.dtype(np.float32)), LAYOUT[1]])


def test_fingerprints_live_apart(tmp_path):
    a = tier(tmp_path, "model-a")
    a.put(key(1), block(1))
    a.flush()
    assert key(1) not in tier(tmp_path, "model-b")  # another model: another namespace, nothing read
    assert key(1) in tier(tmp_path, "model-a")


def test_size_bound_deletes_least_recently_used(tmp_path):
    size = len(encode("model-a", key(0), block(0)))
    t = tier(tmp_path, max_bytes=3 * size)
    for i in range(3):
        t.put(key(i), block(i))
        t.flush()
    os.utime(t._path(key(0)), (1, 1))  # key 1 is now the oldest but key 0 ...
    assert key(0) in t  # ... a read makes key 0 the most recently used
    t.put(key(3), block(3))
    t.flush()
    st = t.stats()
    assert st.files == 3 and st.bytes <= 3 * size and st.evictions == 1
    assert not t._path(key(1)).exists() and all(t._path(key(i)).exists() for i in (0, 2, 3))


def test_an_unwritable_directory_logs_once_and_keeps_answering(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="paged_jax.kv_cache.disk_tier"):
        t = tier(blocked)
        for i in range(3):
            t.put(key(i), block(i))
        t.flush()
    assert key(0) not in t
    assert t.stats().write_errors == 3 and t.stats().files == 0
    assert sum("KV disk tier" in r.message for r in caplog.records) == 1

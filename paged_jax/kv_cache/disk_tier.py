"""The disk tier of the prefix cache: which full blocks survive a restart, and how is a file proven to be ours?

A ``DiskTier`` is a directory of one file per block, named by the block's cache key (the chained hash plus the
group suffix, as on the device and in the host tier) inside a subdirectory named by a *fingerprint* of everything
that determines a block's bytes (the model weights' identity, their dtype, the KV dtype, the page layout, the code
version: `paged_jax.engine.llm_engine`'s `_disk_tier`). Two engines of different models or layouts sharing a
directory never see each other's blocks; two of the same one share them.

Blocks arrive from the host tier: when an offloaded page lands in host memory, its bytes are handed here (``put``)
and written by a background thread (never on a step's path), to a temporary file renamed into place (atomic: a
reader sees a whole file or none, whatever another process does at the same time). A file holds a header (magic,
format version, fingerprint, key, each array's dtype and shape), the arrays' bytes, and an xxh3-128 digest of all
of it. A block is read the first time a lookup asks for it (``__contains__``, which the manager calls on a device
and host miss): a file that is truncated, corrupt, of another fingerprint or key, or unreadable is deleted and
counted, never used; a good one is kept in memory (``take``) until the manager moves it into a host slot.

The directory is bounded (``max_bytes``): past it, the least recently used files (by modification time, which a
read refreshes) are deleted. A fault (an unwritable directory, a full disk) is logged once, counted
(``write_errors``), and the tier keeps serving what it can read; nothing else changes.

With ``record_changes`` on (a cache observer is attached: `paged_jax.kv_cache.tier_events`), every key that enters
the index (a file written) or leaves it (evicted, or rejected on read) is logged in order, on whichever thread
changed it, until the engine thread collects the log (``take_changes``) and reports it as KV events. The index is
this process's: files another process sharing the directory writes or deletes are not in it.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from paged_jax.kv_cache.hashing import BlockHash

log = logging.getLogger(__name__)

MAGIC = b"PJKVBLK1"
SUFFIX = ".kvb"
_U32 = struct.Struct("<I")
DIGEST = 16
MAX_READ_CACHE = 256  # verified blocks kept in memory between a lookup and the admission that takes them


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """The disk tier's counters (cumulative since start-up but ``files``/``bytes``)."""

    files: int
    bytes: int
    hits: int
    """Blocks read back (each one then restored through the host tier)."""
    writes: int
    rejected: int
    """Files found truncated, corrupt or foreign, and deleted."""
    write_errors: int
    evictions: int


def encode(fingerprint: str, key: BlockHash, arrays: list[np.ndarray]) -> bytes:
    """One block's file: header, the arrays' bytes, and the digest of both."""
    fp = fingerprint.encode()
    parts = [MAGIC, _U32.pack(len(fp)), fp, _U32.pack(len(key)), key, _U32.pack(len(arrays))]
    for a in arrays:
        dt = a.dtype.str.encode() if a.dtype.kind != "V" else a.dtype.name.encode()
        parts += [_U32.pack(len(dt)), dt, _U32.pack(a.ndim), *(_U32.pack(d) for d in a.shape)]
    parts += [np.ascontiguousarray(a).tobytes() for a in arrays]
    body = b"".join(parts)
    return body + xxhash.xxh3_128_digest(body)


Layout = list[tuple[tuple[int, ...], np.dtype]]
"""One (page shape, dtype) per cache array."""


def decode(raw: bytes, fingerprint: str, key: BlockHash, like: Layout) -> list[np.ndarray]:
    """The arrays of a block file, or ValueError when it is not exactly this block of this fingerprint in the
    layout ``like`` (shape and dtype per array)."""
    if len(raw) < len(MAGIC) + DIGEST or xxhash.xxh3_128_digest(raw[:-DIGEST]) != raw[-DIGEST:]:
        raise ValueError("digest mismatch (truncated or corrupt)")
    pos = len(MAGIC)
    if raw[:pos] != MAGIC:
        raise ValueError("not a block file")

    def take(n: int) -> bytes:
        nonlocal pos
        out = raw[pos : pos + n]
        pos += n
        return out

    def u32() -> int:
        return _U32.unpack(take(4))[0]

    if take(u32()).decode() != fingerprint:
        raise ValueError("another fingerprint")
    if take(u32()) != key:
        raise ValueError("another block")
    if u32() != len(like):
        raise ValueError("another layout")
    for shape, dtype in like:
        dt = take(u32()).decode()
        dims = tuple(u32() for _ in range(u32()))
        if dims != tuple(shape) or dt not in (dtype.str, dtype.name):
            raise ValueError("another layout")
    out = []
    for shape, dtype in like:
        n = int(np.prod(shape)) * dtype.itemsize
        out.append(np.frombuffer(take(n), dtype).reshape(shape).copy())
    if pos != len(raw) - DIGEST:
        raise ValueError("trailing bytes")
    return out


class DiskTier:
    """A directory of block files for one fingerprint (module docstring)."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"disk tier max_bytes must be >= 1, got {max_bytes}")
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.dir = Path(directory) / xxhash.xxh3_64_hexdigest(fingerprint.encode())
        self.layout: list[tuple[tuple[int, ...], np.dtype]] = []  # set by `bind`
        self.files: OrderedDict[BlockHash, int] = OrderedDict()  # key -> file size, least recently used first
        self._read: OrderedDict[BlockHash, list[np.ndarray]] = OrderedDict()
        self.total_bytes = 0
        self.hits = self.writes = self.rejected = self.write_errors = self.evictions = 0
        self._lock = threading.Lock()  # files / total_bytes, shared with the writer thread
        self._queued: set[BlockHash] = set()
        self.record_changes = False
        """Log the index's changes for ``take_changes`` (off: nothing is kept)."""
        self._changes: list[tuple[BlockHash, bool]] = []  # (key, entered) in order; guarded by _lock
        self._queue: queue.Queue[tuple[BlockHash, list[np.ndarray]] | None] = queue.Queue(maxsize=4096)
        self._warned = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    def bind(self, layout: list[tuple[tuple[int, ...], np.dtype]]) -> None:
        """The page layout a block must have (one (shape, dtype) per cache array, as in the host tier's slots)."""
        self.layout = [(tuple(shape), np.dtype(dtype)) for shape, dtype in layout]

    # -- lookups (the scheduler's thread) ----------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """Whether the block can be restored: read and verified on first ask (a bad file is deleted)."""
        if key in self._read:
            return True
        with self._lock:
            if key not in self.files:
                return False
        assert isinstance(key, bytes)
        arrays = self._load(BlockHash(key))
        if arrays is None:
            return False
        self._read[BlockHash(key)] = arrays
        if len(self._read) > MAX_READ_CACHE:
            self._read.popitem(last=False)
        return True

    def has_file(self, key: BlockHash) -> bool:
        """Whether a file for ``key`` exists (or is queued), without reading it."""
        with self._lock:
            return key in self.files or key in self._queued

    def holds(self, key: BlockHash) -> bool:
        """Whether ``key``'s file is in the index (written, not queued)."""
        with self._lock:
            return key in self.files

    def take_changes(self) -> list[tuple[BlockHash, bool]]:
        """The index's changes since the last call, in order: ``(key, True)`` a file written, ``(key, False)`` one
        evicted or rejected (logged only while ``record_changes`` is on)."""
        with self._lock:
            out, self._changes = self._changes, []
        return out

    def take(self, key: BlockHash) -> list[np.ndarray]:
        """The verified arrays of a block ``__contains__`` answered True for (moved out of the read cache)."""
        self.hits += 1
        return self._read.pop(key)

    # -- writes (from the worker's landing, handed to the writer thread) ----------------------------------------
    def put(self, key: BlockHash, arrays: list[np.ndarray]) -> None:
        """Write a block behind (copied now; a full queue drops it: the disk only ever lags)."""
        with self._lock:
            if key in self.files:
                self.files.move_to_end(key)
                return
            if key in self._queued:
                return
            self._queued.add(key)
        try:
            self._queue.put_nowait((key, [np.array(a) for a in arrays]))
        except queue.Full:
            with self._lock:
                self._queued.discard(key)

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=10)

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                len(self.files),
                self.total_bytes,
                self.hits,
                self.writes,
                self.rejected,
                self.write_errors,
                self.evictions,
            )

    # -- internal ------------------------------------------------------------------------------------------------
    def _path(self, key: BlockHash) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def _scan(self) -> None:
        """Index the files already there, oldest first (their contents are checked when first read)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            found = []
            for entry in os.scandir(self.dir):
                name = entry.name
                if entry.is_file() and name.endswith(SUFFIX):
                    try:
                        key = BlockHash(bytes.fromhex(name[: -len(SUFFIX)]))
                    except ValueError:
                        continue
                    st = entry.stat()
                    found.append((st.st_mtime, key, st.st_size))
        except OSError as e:
            self._fault(f"cannot use {self.dir}: {e}")
            return
        for _, key, size in sorted(found):
            self.files[key] = size
            self.total_bytes += size

    def _load(self, key: BlockHash) -> list[np.ndarray] | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
            arrays = decode(raw, self.fingerprint, key, self.layout)
        except (OSError, ValueError) as e:
            log.warning("KV disk tier: %s rejected (%s), deleted", path.name, e)
            self.rejected += 1
            self._forget(key)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # recently used
        except OSError:
            pass
        with self._lock:
            if key in self.files:
                self.files.move_to_end(key)
        return arrays

    def _forget(self, key: BlockHash) -> None:
        with self._lock:
            size = self.files.pop(key, None)
            if size is not None:
                self.total_bytes -= size
                if self.record_changes:
                    self._changes.append((key, False))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
                with self._lock:
                    self._queued.discard(item[0])
            finally:
                self._queue.task_done()

    def _write(self, key: BlockHash, arrays: list[np.ndarray]) -> None:
        data = encode(self.fingerprint, key, arrays)
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self.write_errors += 1
            self._fault(f"cannot write {path}: {e}")
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        self.writes += 1
        with self._lock:
            if key not in self.files:
                self.files[key] = len(data)
                self.total_bytes += len(data)
                if self.record_changes:
                    self._changes.append((key, True))
            victims = []
            while self.total_bytes > self.max_bytes and len(self.files) > 1:
                old, size = self.files.popitem(last=False)
                self.total_bytes -= size
                victims.append(old)
                if self.record_changes:
                    self._changes.append((old, False))
        for old in victims:
            self.evictions += 1
            try:
                self._path(old).unlink()
            except OSError:
                pass

    def _fault(self, message: str) -> None:
        if not self._warned:
            log.warning("KV disk tier: %s; serving without the blocks it cannot write", message)
            self._warned = True

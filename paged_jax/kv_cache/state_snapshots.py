"""Prefix caching for linear-attention hybrids: snapshots of a sequence's recurrent state at page-aligned points,
keyed by the chained block hash the KV pages use.

A cached prefix of a hybrid needs two things at the hit point ``h``: the full-attention layers' pages of every
block below ``h`` (the KV manager's hit) and the linear layers' state after exactly ``h`` tokens. A state cannot
be cut back to an earlier point, so a hit is the longest ``h`` with both: the manager asks `usable_blocks` to
lower its page hit to the deepest snapshot point at or below it (`KVCacheManager(snapshots=...)`).

Where snapshots are taken (`points`): in a prompt of ``L`` tokens, after every ``interval`` tokens (a multiple of
the page size) and at the end of its last full block, ``floor(L / page_size) * page_size``: the point a later
prompt that extends this one (the next turn of a chat, the same system prompt) hits. The scheduler ends prefill
chunks at these points (the state exists only at a step's end) and, after a chunk that ends at one, the runner
copies the sequence's state slot into a snapshot row (`take_saves`, after the step). A hit copies the snapshot
row into the sequence's slot before the step (`take_restores`).

Keys and lifetime: a snapshot after ``h`` tokens is keyed by the hash of block ``h / page_size - 1``, which chains
every token below ``h`` and the request's extra keys (cache salt, adapter), so a one-token difference anywhere
below ``h`` (or another salt) misses. It lives while that block's page is in the prefix cache: the page's
eviction drops it (`evicted`), as does `clear`. The rows are a fixed number (`capacity`, part of the state pool's
memory); when all are taken the least recently used snapshot is dropped (its pages stay: a later hit is shorter).
A snapshot saved by a step becomes visible to lookups only from the next schedule on (`commit`): a request
admitted in the same step would restore it before the step had written it.

Rows: snapshot ``i`` is row ``first_row + i`` of every linear layer's state arrays, after the sequence slots
(`paged_jax.kv_cache.state_pool`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from paged_jax.kv_cache.hashing import BlockHash
from paged_jax.kv_cache.state_pool import StateCopy


class StateSnapshots:
    """The snapshot rows and their keys (module docstring)."""

    def __init__(self, capacity: int, first_row: int, page_size: int, interval: int) -> None:
        if capacity < 1:
            raise ValueError(f"state_snapshots: must be >= 1, got {capacity!r}")
        if interval < page_size or interval % page_size:
            raise ValueError(f"state_snapshot_interval: a multiple of the page size {page_size}, got {interval!r}")
        self.capacity = capacity
        self.first_row = first_row
        self.page_size = page_size
        self.interval = interval
        self._rows: OrderedDict[BlockHash, int] = OrderedDict()  # live snapshots, least recently used first
        self._pending: dict[BlockHash, int] = {}  # saved by the step being scheduled, visible from the next one
        self._free = list(range(first_row + capacity - 1, first_row - 1, -1))
        self._saves: list[StateCopy] = []
        self._restores: list[StateCopy] = []
        self.num_hits = 0  # restores made
        self.num_saved = 0  # snapshots taken

    @property
    def num_cached(self) -> int:
        return len(self._rows) + len(self._pending)

    def points(self, prompt_len: int) -> list[int]:
        """The snapshot points of a prompt of `prompt_len` tokens, ascending."""
        last = prompt_len // self.page_size * self.page_size
        inner = range(self.interval, last, self.interval)
        return [*inner, last] if last else []

    def next_point(self, prompt_len: int, computed: int) -> int | None:
        """The first snapshot point past `computed` (where a prefill chunk starting there must end), or None."""
        for p in self.points(prompt_len):
            if p > computed:
                return p
        return None

    def usable_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The deepest block count <= `num_blocks` with a live snapshot after it (0: none); `hashes[i]` is block i's
        hash (at least `num_blocks` of them)."""
        for n in range(num_blocks, 0, -1):
            if hashes[n - 1] in self._rows:
                return n
        return 0

    def restore(self, key: BlockHash, slot: int) -> None:
        """A hit: copy snapshot `key` into state slot `slot` before the step."""
        row = self._rows[key]
        self._rows.move_to_end(key)
        self._restores.append(StateCopy(row, slot))
        self.num_hits += 1

    def save(self, key: BlockHash, slot: int) -> None:
        """Snapshot state slot `slot` after the step under `key` (nothing when `key` is already held: the same
        prefix gives the same state)."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return
        if key in self._pending:
            return
        if not self._free:
            if not self._rows:
                return  # every row saved this step: this point is skipped
            _, row = self._rows.popitem(last=False)
            self._free.append(row)
        row = self._free.pop()
        self._pending[key] = row
        self._saves.append(StateCopy(slot, row))
        self.num_saved += 1

    def commit(self) -> None:
        """The last step's saves become hits for lookups (called as a schedule starts)."""
        self._rows.update(self._pending)
        self._pending.clear()

    def evicted(self, key: BlockHash) -> None:
        """The page of block `key` left the prefix cache: its snapshot goes too."""
        row = self._rows.pop(key, None)
        if row is None:
            row = self._pending.pop(key, None)
            if row is not None:
                self._saves = [c for c in self._saves if c.dst != row]
        if row is not None:
            self._free.append(row)

    def clear(self) -> None:
        for key in [*self._rows, *self._pending]:
            self.evicted(key)

    def take_saves(self) -> list[StateCopy]:
        saves, self._saves = self._saves, []
        return saves

    def take_restores(self) -> list[StateCopy]:
        restores, self._restores = self._restores, []
        return restores

    def check(self) -> None:
        """Every row exactly once free or holding one snapshot (RuntimeError naming what is broken)."""
        held = [*self._rows.values(), *self._pending.values()]
        if sorted(held + self._free) != list(range(self.first_row, self.first_row + self.capacity)):
            raise RuntimeError(f"state snapshot invariant broken: held {sorted(held)}, free {sorted(self._free)}")


__all__ = ["StateSnapshots"]

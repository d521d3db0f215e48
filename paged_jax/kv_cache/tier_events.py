"""The host and disk tiers' entries told to a cache observer: which blocks a server holds off the device, as they
change.

A fleet router that weighs a host-tier hit (a copy back, no recompute) needs the host tier's blocks as it has the
device's: `TierReporter` turns the tier's entry changes (`HostTier.on_change`) into the observer's
``blocks_stored`` / ``blocks_removed`` calls with ``tier="host"``. A host-tier block is reported like a device one,
with its parent hash and its tokens, so the reporter remembers them from the block's device report
(``remember``) for as long as any tier holds the block: the device evicting a page is where the tier takes it,
and by then only the hash is left on the page.

The disk tier behind the host tier (`paged_jax.kv_cache.disk_tier`) changes on its writer thread; its log of
written and dropped files is collected on the engine thread (``poll_disk``) and reported with ``tier="disk"``.
``on_disk`` is what the observer was told the disk holds: a file is reported once its origin is known, so a file
found at start-up (a previous run's: the file keeps no tokens) is reported the first time a request's blocks name
it (``remember``), and a file is reported removed only if it was reported stored. A block that left every tier
before its file was written (its write still pending, the host tier's slots all pinned) has no origin left, so its
file is not reported.

Keys here are the manager's cache keys (`KVCacheManager.cache_key`: the block hash, plus the group index past
group 0); the observer is told (group, block hash), as for device blocks.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from paged_jax.kv_cache.hashing import HASH_BYTES, BlockHash
from paged_jax.kv_cache.host_tier import HostTier
from paged_jax.kv_cache.observer import CacheObserver


def split_cache_key(key: BlockHash) -> tuple[int, BlockHash]:
    """A cache key's (group, block hash): keys past group 0 carry the group index after the hash."""
    if len(key) == HASH_BYTES:
        return 0, key
    return int.from_bytes(key[HASH_BYTES:], "little"), BlockHash(key[:HASH_BYTES])


@dataclass(frozen=True, slots=True)
class BlockOrigin:
    """What a stored-block report carries besides the hash: the block before it and the block's tokens."""

    parent: BlockHash | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]
    """The request's extra hash keys (hashed into its first block; the adapter lookup reads them)."""


@dataclass(slots=True)
class TierReporter:
    """Reports `tier`'s entries to `observer` (module docstring); `device` is the device cache's key map."""

    observer: CacheObserver
    tier: HostTier
    device: Container[BlockHash]
    origins: dict[BlockHash, BlockOrigin] = field(default_factory=dict)
    """Every block the device or a tier holds (keyed by cache key), as its device report told it."""
    on_disk: set[BlockHash] = field(default_factory=set)
    """The disk tier's files reported stored (and not removed since)."""

    def remember(
        self,
        keys: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
    ) -> None:
        """Consecutive blocks ``keys`` (the first after ``parent``) were reported stored on the device."""
        ps = len(token_ids) // len(keys) if keys else 0
        disk = self.tier.disk
        for i, key in enumerate(keys):
            self.origins[key] = BlockOrigin(parent, tuple(token_ids[i * ps : (i + 1) * ps]), extra_keys)
            parent = BlockHash(key[:HASH_BYTES])
            if disk is not None and key not in self.on_disk and disk.holds(key):  # a file its tokens now name
                self._report_disk(key)

    def device_evicted(self, key: BlockHash) -> None:
        """The device evicted ``key`` (after the tier was offered it): forgotten unless a tier took it."""
        if not self._held_off_device(key):
            self.origins.pop(key, None)

    def changed(self, key: BlockHash, stored: bool) -> None:
        """`HostTier.on_change`: report the entry; a dropped one the device does not hold is forgotten."""
        group, block_hash = split_cache_key(key)
        if not stored:
            self.observer.blocks_removed(group, (block_hash,), tier="host")
            if key not in self.device and not self._held_off_device(key):
                self.origins.pop(key, None)
            return
        origin = self.origins.get(key)
        if origin is not None:  # None: cached before the observer was set, so never reported on the device either
            self.observer.blocks_stored(
                group, (block_hash,), origin.parent, origin.token_ids, origin.extra_keys, tier="host"
            )

    def poll_disk(self) -> None:
        """Report the disk tier's files written and dropped since the last poll (engine thread)."""
        disk = self.tier.disk
        if disk is None:
            return
        for key, stored in disk.take_changes():
            if stored:
                if key not in self.on_disk and key in self.origins:
                    self._report_disk(key)
                continue
            if key in self.on_disk:
                self.on_disk.discard(key)
                group, block_hash = split_cache_key(key)
                self.observer.blocks_removed(group, (block_hash,), tier="disk")
            if key not in self.device and not self._held_off_device(key):
                self.origins.pop(key, None)

    def cleared(self) -> None:
        """Every device entry was dropped (and reported cleared): store the tiers' entries again, forget the rest."""
        for key in list(self.origins):
            if not self._held_off_device(key):
                del self.origins[key]
        for key in self.tier.entries:
            self.changed(key, True)
        for key in list(self.on_disk):
            self.on_disk.discard(key)
            self._report_disk(key)

    def _held_off_device(self, key: BlockHash) -> bool:
        """Whether the host tier holds ``key``, or the disk tier has (or is writing) its file."""
        disk = self.tier.disk
        return key in self.tier.entries or key in self.on_disk or (disk is not None and disk.has_file(key))

    def _report_disk(self, key: BlockHash) -> None:
        origin = self.origins[key]
        group, block_hash = split_cache_key(key)
        self.observer.blocks_stored(
            group, (block_hash,), origin.parent, origin.token_ids, origin.extra_keys, tier="disk"
        )
        self.on_disk.add(key)

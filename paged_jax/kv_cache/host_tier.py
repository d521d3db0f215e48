"""The host-memory tier of the prefix cache: where does a full block live once the device evicted its page?

A ``HostTier`` is a pool of ``capacity`` host slots, each holding one device page's bytes (every layer slab, the
same layout and dtype as on the device, int8/fp8 scale rows included) in numpy arrays ``[capacity, ...]`` per
array of the device cache (``bind``). It is keyed exactly as the device prefix cache is: the chained block hash
plus the group suffix (``KVCacheManager.cache_key``), so the cache salt, the LoRA adapter and the group separate
entries here as they do on the device.

The manager decides, the worker copies (`paged_jax.worker.kv_transfer`): when the device pool evicts a cached page,
the manager asks the tier for a slot (``offload``) and records a device -> host copy; when a prefix lookup misses on
the device but the tier holds the block, ``admit`` allocates a fresh page and records a host -> device copy
(``claim``, ``restore``). Those copies are collected per step (``take``, once the scheduler has decided the step)
and run by the worker before the step's forward pass: offloads read the evicted pages before any write of the step,
restores write them before any read.

Step discipline (why nothing stale is ever read):
  * an entry offloaded this step is *in flight*: its bytes reach the host only once the worker has run the step's
    copies, so it is not a hit until ``take`` (the next step's lookups may hit it; the worker lands a step's
    offloads before it reads the next step's restores);
  * an entry restored this step, and one in flight, is *pinned*: the tier's LRU never hands its slot to another
    block in the same step.
The tier is inclusive: a restored entry stays in the tier, so evicting its device page again costs no copy.

Swap (`paged_jax.kv_cache.swap`): a preempted request's pages can be copied into slots ``reserve`` takes out of
the LRU; those slots are no entry's (no lookup finds them) and stay pinned until the request is swapped back in
or aborted (``release``). A reservation whose copies are not taken yet is *in flight* (``swap_in_flight``); a step
that runs nothing cancels it (``cancel``), since its copies would never run.
LRU within the tier: a hit (restore) or a repeated offload makes an entry most recently used; a full tier reuses
the least recently used unpinned slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from paged_jax.kv_cache.disk_tier import DiskTier
from paged_jax.kv_cache.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class SlotCopy:
    """One page copy between the device and the host tier: device page ``page`` <-> host slot ``slot`` (-1: no
    slot, a block written to the disk tier only); ``key``: the block's cache key."""

    page: int
    slot: int
    key: bytes = b""


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """A block read from the disk tier, copied into device page ``page``: one array per cache array."""

    page: int
    arrays: list[np.ndarray]


@dataclass(slots=True)
class KVTransfers:
    """A step's copies between the device pages and the host tier, in the order the worker runs them."""

    offloads: list[SlotCopy] = field(default_factory=list)
    """Device -> host: evicted pages, read before the step writes any page."""
    restores: list[SlotCopy] = field(default_factory=list)
    """Host -> device: freshly allocated pages filled before the step reads any page."""
    loads: list[BlockLoad] = field(default_factory=list)
    """Disk -> device: like ``restores``, from blocks the disk tier read back."""
    persists: list[SlotCopy] = field(default_factory=list)
    """Device -> disk: blocks the previous step computed (cached then, written by its forward pass), read before this
    step writes any page and written behind to the disk tier (slot -1)."""

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores or self.loads or self.persists)


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """The host tier's counters (cumulative since start-up but ``pages_held``)."""

    pages_capacity: int
    pages_held: int
    hits: int
    """Blocks a prefix lookup found in the tier only (each one restored)."""
    offloads: int
    """Evicted device pages copied into the tier."""
    evictions: int
    """Tier entries dropped to make room for newer ones."""
    bytes_to_host: int
    bytes_to_device: int
    copy_seconds: float
    """Host time spent issuing and landing the copies."""
    swap_outs: int = 0
    """Preempted requests whose pages were copied here instead of being recomputed later."""
    swap_ins: int = 0
    """Swapped requests copied back into device pages."""
    swap_pages_held: int = 0
    """Slots held by swapped-out requests now (pinned until they resume or are aborted)."""
    swap_bytes_to_host: int = 0
    swap_bytes_to_device: int = 0


class HostTier:
    """Slots of host memory for evicted full blocks, keyed like the device prefix cache (module docstring)."""

    def __init__(self, capacity: int, disk: DiskTier | None = None) -> None:
        """``disk``: the tier behind this one (`paged_jax.kv_cache.disk_tier`): every block landed here and every
        block the device computes is written there behind, and a block neither the device nor this tier holds is
        read back from it."""
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"host tier capacity must be an int >= 1 (pages), got {capacity!r}")
        self.capacity = capacity
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()  # key -> slot, least recently used first
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.in_flight: set[BlockHash] = set()
        self.pinned: set[int] = set()  # slots restored or offloaded this step
        self.reserved: set[int] = set()  # slots of swapped-out requests: no entry's, never reused until released
        self.swap_in_flight: set[int] = set()  # reserved slots whose copies the next `take` hands out
        self.pending = KVTransfers()
        self.disk = disk
        self.on_change: Callable[[BlockHash, bool], None] | None = None
        """Told ``(key, True)`` when a block becomes an entry and ``(key, False)`` when one is dropped (the
        manager reports them as the host tier's KV events)."""
        self._persist_next: list[SlotCopy] = []  # blocks cached this step: their KV exists once the step ran
        self._persist_ready: list[SlotCopy] = []  # blocks cached the step before: the next step's copies read them
        self.arrays: list[np.ndarray] = []  # per device cache array: [capacity, ...one page]; set by `bind`
        self.page_bytes = 0
        self.hits = 0
        self.offloads = 0
        self.evictions = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.copy_seconds = 0.0
        self.swap_outs = 0
        self.swap_ins = 0
        self.swap_bytes_to_host = 0
        self.swap_bytes_to_device = 0

    def bind(self, page_shapes: Sequence[tuple[tuple[int, ...], np.dtype]]) -> None:
        """Allocate the slots' arrays: one ``[capacity, *shape]`` array of ``dtype`` per array of the device cache
        (``shape``: one page of it, every layer slab). Zeroed lazily by the OS (untouched slots cost nothing)."""
        self.arrays = [np.zeros((self.capacity, *shape), dtype) for shape, dtype in page_shapes]
        self.page_bytes = sum(a[0].nbytes for a in self.arrays)

    # -- what the manager asks ---------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` can be restored now (held and not in flight, or the disk tier has it)."""
        if key in self.entries:
            return key not in self.in_flight
        return self.disk is not None and key in self.disk

    def __len__(self) -> int:
        return len(self.entries)

    def offload(self, key: BlockHash, page: int) -> None:
        """The device evicts ``page`` holding ``key``: copy it in unless the tier holds it already (then it only
        becomes most recently used). A tier whose every slot is pinned this step drops the block."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.entries[key] = slot
        self.in_flight.add(key)
        self.pinned.add(slot)
        self.pending.offloads.append(SlotCopy(page, slot, key))
        self.offloads += 1
        if self.on_change is not None:
            self.on_change(key, True)

    def claim(self, key: BlockHash) -> int | list[np.ndarray]:
        """A lookup hit ``key``: pin its slot for this step and return it (``restore`` then names the device page it
        goes to; pinned first, so allocating that page cannot evict it); a block only the disk tier holds: its
        arrays, read and verified already."""
        if key not in self.entries:
            assert self.disk is not None, "a claimed key is held here or on disk"
            return self.disk.take(key)
        slot = self.entries[key]
        self.entries.move_to_end(key)
        self.pinned.add(slot)
        self.hits += 1
        return slot

    def restore(self, source: int | list[np.ndarray], page: int) -> None:
        """Copy the claimed ``source`` (a slot, or a disk block's arrays) into the fresh device ``page`` this step."""
        if isinstance(source, int):
            self.pending.restores.append(SlotCopy(page, source))
        else:
            self.pending.loads.append(BlockLoad(page, source))

    def persist(self, key: BlockHash, page: int) -> None:
        """The device cached a new full block in ``page`` this step: write it to the disk tier (if there is one and
        it lacks the block) once the step has computed it (the next step's copies read it)."""
        if self.disk is not None and not self.disk.has_file(key):
            self._persist_next.append(SlotCopy(page, -1, key))

    # -- swap (`paged_jax.kv_cache.swap`) ------------------------------------------------------------------------
    def reserve(self, n: int) -> list[int] | None:
        """``n`` slots for a swapped-out request, all or none (None: the free and unpinned slots do not suffice);
        least recently used entries are dropped to make room."""
        unpinned = sum(1 for slot in self.entries.values() if slot not in self.pinned)
        if n > len(self.free_slots) + unpinned:
            return None
        slots = [self._take_slot() for _ in range(n)]
        assert None not in slots
        out = [s for s in slots if s is not None]
        self.reserved.update(out)
        self.swap_in_flight.update(out)
        return out

    def swap_out(self, page: int, slot: int) -> None:
        """Copy device ``page`` into the reserved ``slot`` with this step's offloads (no key: never persisted)."""
        self.pending.offloads.append(SlotCopy(page, slot))
        self.swap_bytes_to_host += self.page_bytes

    def swap_in(self, slot: int, page: int) -> None:
        """Copy the reserved ``slot`` into the fresh device ``page`` with this step's restores (``release`` the
        slot after: the restore reads it when the step's copies are issued, before any later copy lands in it)."""
        assert slot in self.reserved and slot not in self.swap_in_flight, slot
        self.pending.restores.append(SlotCopy(page, slot))
        self.swap_bytes_to_device += self.page_bytes

    def release(self, slots: Sequence[int]) -> None:
        """Give reserved slots back (their request resumed or was aborted)."""
        for slot in slots:
            self.reserved.remove(slot)
            self.swap_in_flight.discard(slot)
            self.free_slots.append(slot)

    def cancel(self, slots: Sequence[int]) -> None:
        """Undo a reservation whose copies were never taken: drop them from this step's offloads and release."""
        gone = set(slots)
        assert gone <= self.swap_in_flight, "only a reservation not yet taken can be cancelled"
        self.pending.offloads = [c for c in self.pending.offloads if c.key or c.slot not in gone]
        self.swap_bytes_to_host -= len(gone) * self.page_bytes
        self.release(slots)

    def take(self) -> KVTransfers | None:
        """The step's copies (None when there are none); the step is decided, so its in-flight entries become hits
        for the next one and its pins are lifted."""
        out = self.pending
        self.in_flight.clear()
        self.pinned.clear()
        self.swap_in_flight.clear()
        # the previous step's new blocks are computed once it ran: this step's copies read them; this step's wait
        out.persists, self._persist_ready, self._persist_next = self._persist_ready, self._persist_next, []
        if not out:
            return None
        self.pending = KVTransfers()
        return out

    def drain_persists(self) -> list[SlotCopy]:
        """Every block waiting to be written to the disk tier, for an idle engine (no step in flight: all of them
        are computed)."""
        out = self._persist_ready + self._persist_next
        self._persist_ready, self._persist_next = [], []
        return out

    def stats(self) -> HostTierStats:
        return HostTierStats(
            pages_capacity=self.capacity,
            pages_held=len(self.entries),
            hits=self.hits,
            offloads=self.offloads,
            evictions=self.evictions,
            bytes_to_host=self.bytes_to_host,
            bytes_to_device=self.bytes_to_device,
            copy_seconds=self.copy_seconds,
            swap_outs=self.swap_outs,
            swap_ins=self.swap_ins,
            swap_pages_held=len(self.reserved),
            swap_bytes_to_host=self.swap_bytes_to_host,
            swap_bytes_to_device=self.swap_bytes_to_device,
        )

    def check(self) -> None:
        """Consistency (tests and debugging): every slot free, one entry's or reserved by a swapped request,
        in-flight keys held; raises RuntimeError naming the broken invariant."""
        slots = list(self.entries.values())
        if len(set(slots)) != len(slots):
            raise RuntimeError("host tier invariant broken: two entries share a slot")
        free = set(self.free_slots)
        if (
            set(slots) & free
            or set(slots) & self.reserved
            or free & self.reserved
            or len(slots) + len(self.free_slots) + len(self.reserved) != self.capacity
        ):
            raise RuntimeError("host tier invariant broken: slots are not partitioned into held, reserved and free")
        if not self.swap_in_flight <= self.reserved:
            raise RuntimeError("host tier invariant broken: a swap copy in flight has no reserved slot")
        if not self.in_flight <= self.entries.keys():
            raise RuntimeError("host tier invariant broken: an in-flight key is not held")

    # -- internal ------------------------------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.entries.items():  # least recently used first; pinned slots are few (this step's)
            if slot not in self.pinned:
                del self.entries[key]
                self.evictions += 1
                if self.on_change is not None:
                    self.on_change(key, False)
                return slot
        return None

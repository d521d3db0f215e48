"""A snapshot of the KV-cache manager's state, for metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass

from paged_jax.kv_cache.disk_tier import DiskTierStats
from paged_jax.kv_cache.host_tier import HostTierStats


@dataclass(slots=True, frozen=True)
class GroupStats:
    """One KV cache group's pages (`paged_jax.kv_cache.groups`)."""

    window: int | None
    """The group's sliding window in tokens; None: full attention."""
    num_layers: int
    """Layers in the group (0: a manager not told about layers)."""
    pages_in_use: int
    """Distinct pages some request's table of this group holds."""


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    """Counts are in pages unless the name says tokens; prefix counters are cumulative since start-up.

    Pages partition as ``pages_total = pages_in_use + pages_free`` (the null page is not counted), and
    ``pages_cached_free`` is the part of ``pages_free`` that still holds a findable prefix block.
    """

    pages_total: int
    """Usable pages: ``num_pages - 1`` (page 0 is the null page)."""
    pages_free: int
    """Pages with refcount 0, cached-but-free included (they are reclaimed on demand)."""
    pages_cached_free: int
    pages_in_use: int
    slot_utilization: float
    """Token slots holding live tokens over token slots in pages in use (1.0 when none in use)."""
    kv_utilization: float
    """Layer-token slots some layer can still read (a window layer reads only its window) over the layer-token
    slots of the pages in use (1.0 when none in use); equals ``slot_utilization`` without windows."""
    prefix_queries: int
    """Prompt tokens looked up at admission (``admit`` calls that succeeded)."""
    prefix_hits: int
    """Of those, tokens served from the prefix cache, whichever tier held them."""
    prefix_hit_rate: float
    """``prefix_hits / prefix_queries`` (0.0 before the first query)."""
    evictions: int
    """Cached pages whose hash was dropped because the page was reused."""
    groups: tuple[GroupStats, ...] = ()
    """Per KV cache group, in the manager's group order."""
    prefix_hits_host: int = 0
    """Of ``prefix_hits``, tokens of blocks restored from the host tier (the rest were on the device)."""
    host: HostTierStats | None = None
    """The host tier's (`paged_jax.kv_cache.host_tier`); None: no host tier."""
    disk: DiskTierStats | None = None
    """The disk tier's (`paged_jax.kv_cache.disk_tier`); None: no disk tier."""

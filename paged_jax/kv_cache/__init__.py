"""Paged KV cache, host side: the manager the scheduler talks to (per-request block tables, one per KV cache
group; prefix cache; copy-on-write forks) over the page pool, the host tier evicted blocks and swapped-out
requests go to, and the state slots of linear-attention layers (`state_pool`). The device page arrays live in
`paged_jax.worker.kv_allocation`."""

from paged_jax.kv_cache.disk_tier import DiskTier, DiskTierStats
from paged_jax.kv_cache.groups import FULL, KVGroup, KVLayout, kv_layout
from paged_jax.kv_cache.hashing import BlockHash, BlockHasher
from paged_jax.kv_cache.host_tier import BlockLoad, HostTier, HostTierStats, KVTransfers, SlotCopy
from paged_jax.kv_cache.manager import KVCacheManager, PageCopy
from paged_jax.kv_cache.page_pool import NULL_PAGE
from paged_jax.kv_cache.state_pool import NULL_SLOT, StateCopy, StateSlots
from paged_jax.kv_cache.stats import GroupStats, KVCacheStats
from paged_jax.kv_cache.swap import PREEMPTION_MODES, PreemptionMode, SwapCosts, SwapSpace

__all__ = [
    "BlockLoad",
    "DiskTier",
    "DiskTierStats",
    "FULL",
    "NULL_PAGE",
    "NULL_SLOT",
    "BlockHash",
    "BlockHasher",
    "GroupStats",
    "HostTier",
    "HostTierStats",
    "KVCacheManager",
    "KVCacheStats",
    "KVGroup",
    "KVLayout",
    "KVTransfers",
    "PREEMPTION_MODES",
    "PageCopy",
    "PreemptionMode",
    "SlotCopy",
    "StateCopy",
    "StateSlots",
    "SwapCosts",
    "SwapSpace",
    "kv_layout",
]

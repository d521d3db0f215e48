"""Paged KV cache, host side: the manager the scheduler talks to (per-request page tables, prefix cache,
copy-on-write forks) over the page pool. The device page arrays live in `paged_jax.worker.kv_allocation`."""

from paged_jax.kv_cache.hashing import BlockHash, BlockHasher
from paged_jax.kv_cache.manager import KVCacheManager, PageCopy
from paged_jax.kv_cache.page_pool import NULL_PAGE
from paged_jax.kv_cache.stats import KVCacheStats

__all__ = ["NULL_PAGE", "BlockHash", "BlockHasher", "KVCacheManager", "KVCacheStats", "PageCopy"]

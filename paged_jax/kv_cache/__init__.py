"""Paged KV cache: the host-side manager (pool, prefix cache, copy-on-write); later the device pages."""

from paged_jax.kv_cache.block_pool import NULL_PAGE
from paged_jax.kv_cache.hashing import BlockHash, BlockHasher
from paged_jax.kv_cache.manager import KVCacheManager
from paged_jax.kv_cache.stats import KVCacheStats

__all__ = ["NULL_PAGE", "BlockHash", "BlockHasher", "KVCacheManager", "KVCacheStats"]

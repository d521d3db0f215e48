"""Who hears about the prefix cache's contents changing: the observer interface the manager calls.

The manager calls an observer at the three places its cache map changes: a full block becomes a cache entry
(``blocks_stored``, from the manager's block caching), a cached block's page is handed out again and its entry
evicted (``blocks_removed``, from the pool's lazy eviction), and every entry is dropped at once
(``cleared``, `KVCacheManager.reset_prefix_cache`). Replaying the calls in order rebuilds the cache map's key
set exactly: an entry is reported stored once, when it enters, and removed once, when it leaves.

The observer runs on the engine's thread inside the manager's calls, so it must only record (never block, never
call back into the manager); `paged_jax.kv_cache.events` records them as vLLM's KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged_jax.kv_cache.hashing import BlockHash


class CacheObserver(Protocol):
    """Told every change of the prefix cache's entries (module docstring)."""

    def blocks_stored(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
    ) -> None:
        """Consecutive full blocks of one request became entries of KV cache group ``group``: ``block_hashes[i]``
        names block ``i`` of the run, whose tokens are ``token_ids[i * page_size:(i + 1) * page_size]``;
        ``parent_hash`` is the hash of the block before the run (None: the run starts the prompt);
        ``extra_keys``: the request's extra hash keys (cache salt, adapter digest; in the first block's hash)."""

    def blocks_removed(self, group: int, block_hashes: Sequence[BlockHash]) -> None:
        """Entries of group ``group`` were evicted (their pages reused)."""

    def cleared(self) -> None:
        """Every entry of every group was dropped."""

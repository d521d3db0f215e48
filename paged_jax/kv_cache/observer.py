"""Who hears about the prefix cache's contents changing: the observer interface the manager calls.

The manager calls an observer at the places its cache map changes: a full block becomes a cache entry
(``blocks_stored``: computed by a request, restored from the host tier, or re-cached by a swapped-in request), a
cached block's page is handed out again and its entry evicted (``blocks_removed``, from the pool's lazy eviction),
and every entry is dropped at once (``cleared``, `KVCacheManager.reset_prefix_cache`). With a host tier
(`paged_jax.kv_cache.host_tier`) the same two calls with ``tier="host"`` tell the tier's entries: a block the
device evicted is stored there (right after its device removal), and removed when the tier reuses its slot; a
restore leaves it there (the tier is inclusive) and stores it on the device again. Replaying the calls in order
rebuilds both key sets exactly: an entry is reported stored once per tier, when it enters, and removed once, when
it leaves; after ``cleared`` (every device entry dropped) the host tier's entries are stored again, so a consumer
that drops every tier on a clear loses none. With a disk tier behind the host tier
(`paged_jax.kv_cache.disk_tier`) ``tier="disk"`` tells its files the same way: a block is stored there once its
file is written (on the writer thread, reported at the engine thread's next collection), removed when the file
is evicted or found bad, and stored again after ``cleared`` (the files stay).

The observer runs on the engine's thread inside the manager's calls, so it must only record (never block, never
call back into the manager); `paged_jax.kv_cache.events` records them as vLLM's KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from paged_jax.kv_cache.hashing import BlockHash

Tier = Literal["device", "host", "disk"]
"""Where an entry lives: the device's pages, the host tier's slots or the disk tier's files."""


class CacheObserver(Protocol):
    """Told every change of the prefix cache's entries (module docstring)."""

    def blocks_stored(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        tier: Tier = "device",
    ) -> None:
        """Consecutive full blocks of one prompt became entries of KV cache group ``group`` in ``tier``:
        ``block_hashes[i]`` names block ``i`` of the run, whose tokens are
        ``token_ids[i * page_size:(i + 1) * page_size]``; ``parent_hash`` is the hash of the block before the run
        (None: the run starts the prompt); ``extra_keys``: the request's extra hash keys (cache salt, adapter
        digest; in the first block's hash)."""

    def blocks_removed(self, group: int, block_hashes: Sequence[BlockHash], tier: Tier = "device") -> None:
        """Entries of group ``group`` left ``tier`` (their pages or slots reused)."""

    def cleared(self) -> None:
        """Every entry of every group was dropped."""

"""KV cache events as vLLM publishes them: which blocks a server's prefix cache holds, told as they change.

A fleet router (vLLM's router, llm-d, NVIDIA Dynamo) keeps an index of every server's cached blocks from these
events and sends a request where its prefix is cached. The records mirror vLLM's `vllm.distributed.kv_events`
structs field for field (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, batched per engine step into a
`KVEventBatch`); `serve.kv_events` encodes them in vLLM's msgpack layout and publishes them.

What the fields carry here: a block hash is this engine's 16-byte chained digest (`paged_jax.kv_cache.hashing`;
vLLM's `ExternalBlockHash` is `bytes | int`, bytes by default), `parent_block_hash` the digest of the block
before the run, `token_ids` the run's tokens, `block_size` the page size, `group_idx` the KV cache group (with
the group's kind and window on stored events, as vLLM annotates them), `medium` the tier holding the pages
("GPU", vLLM's name for the accelerator's memory, whatever the accelerator; "CPU" for the host tier, as vLLM's
offloading connector names its CPU blocks; "STORAGE", vLLM's `MEDIUM_STORAGE`, for the disk tier), and for a
request with a LoRA adapter `lora_id` / `lora_name` (its `lora_int_id` and name) from the adapter lookup the
engine provides. A block the host or disk tier takes is published with its parent hash and tokens like a device
block (vLLM's offloading connector sends none; a router that keys its index by the tokens, as vLLM's router does,
can place a host- or disk-tier block only with them).
``extra_keys`` lists, per block, the keys hashed into it beyond its tokens: the first block of a prompt carries
the request's cache salt and adapter digest, every later one none (None).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from paged_jax.kv_cache.groups import KVGroup
from paged_jax.kv_cache.hashing import BlockHash
from paged_jax.kv_cache.observer import Tier

MEDIUM_DEVICE = "GPU"
"""vLLM's `MEDIUM_GPU`: the accelerator's memory."""
MEDIUM_HOST = "CPU"
"""vLLM's offloading connector's medium for blocks in host memory: the host tier."""
MEDIUM_DISK = "STORAGE"
"""vLLM's `MEDIUM_STORAGE` (its file-system offloading tier's blocks): the disk tier."""
MEDIA: dict[Tier, str] = {"device": MEDIUM_DEVICE, "host": MEDIUM_HOST, "disk": MEDIUM_DISK}

LoraLookup = Callable[[tuple[str, ...]], "tuple[int, str] | None"]
"""A request's extra hash keys -> its adapter's (lora_int_id, name), None without an adapter."""


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks of one request entered the cache (vLLM's `BlockStored`, fields in its order)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks were evicted (vLLM's `BlockRemoved`)."""

    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached block was dropped (vLLM's `AllBlocksCleared`)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One engine step's events (vLLM's `KVEventBatch`): ``ts`` wall-clock seconds, ``data_parallel_rank`` the
    replica that emitted them."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class EventRecorder:
    """The `CacheObserver` that records the cache's changes as vLLM's events until `take` collects them.

    Runs inside the manager's calls on the engine thread: it only appends to a list (bounded by what one step can
    change, since the engine loop takes the list after every step)."""

    block_size: int
    groups: Sequence[KVGroup]
    lora_lookup: LoraLookup | None = None
    data_parallel_rank: int | None = None
    events: list[KVCacheEvent] = field(default_factory=list)

    def blocks_stored(
        self,
        group: int,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[str, ...],
        tier: Tier = "device",
    ) -> None:
        lora = self.lora_lookup(extra_keys) if self.lora_lookup is not None and extra_keys else None
        keys: list[tuple[str, ...] | None] | None = None
        if extra_keys and parent_hash is None:  # the run starts the prompt: its first block hashed the keys
            keys = [extra_keys, *([None] * (len(block_hashes) - 1))]
        window = self.groups[group].window
        self.events.append(
            BlockStored(
                block_hashes=list(block_hashes),
                parent_block_hash=parent_hash,
                token_ids=[int(t) for t in token_ids],
                block_size=self.block_size,
                lora_id=None if lora is None else lora[0],
                medium=MEDIA[tier],
                lora_name=None if lora is None else lora[1],
                extra_keys=keys,
                group_idx=group,
                kv_cache_spec_kind="full_attention" if window is None else "sliding_window",
                kv_cache_spec_sliding_window=window,
            )
        )

    def blocks_removed(self, group: int, block_hashes: Sequence[BlockHash], tier: Tier = "device") -> None:
        medium = MEDIA[tier]
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.group_idx == group and last.medium == medium:
            last.block_hashes.extend(block_hashes)  # one event per run of evictions
            return
        self.events.append(BlockRemoved(block_hashes=list(block_hashes), medium=medium, group_idx=group))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> KVEventBatch | None:
        """The events recorded since the last call as one batch (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)

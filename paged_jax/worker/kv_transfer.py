"""How do pages move between the device KV cache and the host tier? Batched, fixed-shape copies per step.

The KV manager decides which pages move (`paged_jax.kv_cache.host_tier`); the scheduler's output carries a step's
`KVTransfers`, and the runner hands them here before the step's forward pass, in this order:

  1. land the previous steps' offloads: their gathered pages (already copying to the host asynchronously since
     they were gathered) are written into the tier's numpy slots;
  2. gather this step's offloads (evicted pages, read before anything of this step writes a page) into one
     device array per cache array, ``[n, slabs, ...page]``, and start their copy to the host;
  3. scatter this step's restores (host slots -> fresh pages) and disk loads (blocks the disk tier read back) into
     the cache, in place under donation.

With a disk tier (`paged_jax.kv_cache.disk_tier`), the previous step's newly cached blocks are gathered with the
offloads (``persists``, no host slot), and every landed block is handed to the disk tier's writer thread.

Each copy is one jitted executable per count bucket (powers of two, larger batches in chunks of the largest), so a
steady state compiles nothing; `compile_count` counts them. A cache array is ``[slabs * num_pages, ...]`` (a
stacked cache: slab ``l``'s page ``p`` at ``l * num_pages + p``) or ``[num_pages, ...]`` per layer; a host slot
holds every slab of one page of every array, int8/fp8 scale rows included, in the device dtype.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

from paged_jax.kv_cache import BlockHash, HostTier, KVLayout, KVTransfers, SlotCopy
from paged_jax.worker.buckets import bucket_for, pow2_buckets

COPY_BUCKETS = pow2_buckets(8, 128)  # pages per executable; more in chunks of the largest
DISK_ONLY_HOST_PAGES = 64  # the host tier a disk tier gets when the host tier is off: it carries the copies
FORMAT_VERSION = 1  # of a block's bytes: bump when the KV a model writes changes (kernels, RoPE, quantization)
WEIGHT_SAMPLE = 4096  # elements of each weight array, evenly strided, that name the weights in the fingerprint
_COMPILED: dict[tuple, jax.stages.Compiled] = {}  # (kind, bucket, pages, cache arrays' avals) -> executable
HOST_TIER_SHARE = 0.3  # of the host memory available at start-up, the default host tier on TPU/GPU


def host_tier_pages(gib: float | None, page_bytes: int, platform: str, replicas: int = 1) -> int:
    """Host-tier slots for a budget of ``gib`` GiB (None: the platform default: off on CPU, where the device pages
    already are host memory and a copy would only move bytes within it; on TPU/GPU ``HOST_TIER_SHARE`` of the host
    memory available now, split between the ``replicas`` engines this process can run on its devices). 0: no
    tier."""
    if gib is None:
        if platform == "cpu":
            return 0
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(HOST_TIER_SHARE * available / max(1, replicas)) // page_bytes
    return int(gib * 2**30) // page_bytes


def block_fingerprint(config, params, kv_dtype, page_size: int, layout: KVLayout) -> str:
    """What determines a block's bytes, as one string (the disk tier's namespace): the code and format version,
    the model config, the KV dtype, the page size and layout, and the weights' identity (every array's path,
    shape, dtype and an evenly strided sample of its values; reading them all would cost a full copy)."""
    h = xxhash.xxh3_128()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        h.update(f"{jax.tree_util.keystr(path)} {tuple(leaf.shape)} {leaf.dtype}".encode())
        flat = jnp.reshape(leaf, (-1,))
        sample = np.asarray(flat[:: max(1, flat.shape[0] // WEIGHT_SAMPLE)][:WEIGHT_SAMPLE])
        h.update(sample.tobytes())
    h.update(f"{config!r} {np.dtype(kv_dtype).name} {page_size} {layout!r}".encode())
    try:
        version = importlib.metadata.version("paged-jax")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        version = "unknown"
    return f"paged-jax {version} format {FORMAT_VERSION} {h.hexdigest()}"


@dataclass(slots=True)
class _Landing:
    """Gathered pages on their way to the host: row ``i`` of ``arrays`` goes to ``copies[i]``'s slot (none: -1)
    and, with a disk tier, to its file."""

    arrays: list[jax.Array]
    copies: list[SlotCopy]


def _gather(leaves: list[jax.Array], pages: jax.Array, num_pages: int) -> list[jax.Array]:
    """Every slab of pages ``pages`` [n] of each cache array: ``[n, slabs, ...page]`` each."""
    out = []
    for x in leaves:
        slabs = x.shape[0] // num_pages
        out.append(jnp.swapaxes(x.reshape(slabs, num_pages, *x.shape[1:])[:, pages], 0, 1))
    return out


def _scatter(leaves: list[jax.Array], pages: jax.Array, data: list[jax.Array], num_pages: int) -> list[jax.Array]:
    """``leaves`` with every slab of page ``pages[i]`` replaced by ``data[.][i]``; an index past the cache (padding)
    writes nothing."""
    out = []
    for x, d in zip(leaves, data, strict=True):
        slabs = x.shape[0] // num_pages
        rows = (jnp.arange(slabs, dtype=jnp.int32)[:, None] * num_pages + pages[None]).reshape(-1)
        out.append(x.at[rows].set(jnp.swapaxes(d, 0, 1).reshape(-1, *x.shape[1:]), mode="drop"))
    return out


class KVTransfer:
    """Runs a step's `KVTransfers` on a runner's cache (module docstring) and owns their executables."""

    def __init__(self, kv_caches, num_pages: int, tier: HostTier) -> None:
        leaves, self.treedef = jax.tree.flatten(kv_caches)
        self.num_pages = num_pages
        self.tier = tier
        self.shardings = [x.sharding for x in leaves]
        self.pad = max(x.shape[0] for x in leaves)  # a page index every array drops (slab 0 already past its end)
        layout = [((x.shape[0] // num_pages, *x.shape[1:]), np.dtype(x.dtype)) for x in leaves]
        tier.bind(layout)
        if tier.disk is not None:
            tier.disk.bind(layout)
        self._gather = jax.jit(_gather, static_argnums=(2,))
        self._scatter = jax.jit(_scatter, static_argnums=(3,), donate_argnums=(0,), out_shardings=self.shardings)
        self.compile_count = 0  # copy executables this transfer compiled (at most two per bucket)
        self._landing: list[_Landing] = []

    def compile_all(self, kv_caches) -> None:
        """Compile every copy bucket now (the engine's warm-up), so that no step waits for one."""
        leaves = jax.tree.leaves(kv_caches)
        for n in COPY_BUCKETS:
            self._executable("gather", n, leaves)
            self._executable("scatter", n, leaves)

    def apply(self, kv_caches, transfers: KVTransfers):
        """Run `transfers` on `kv_caches` (donated); returns the new caches."""
        t0 = time.perf_counter()
        self.land()
        leaves = jax.tree.leaves(kv_caches)
        for chunk in _chunks(transfers.offloads + transfers.persists):
            pages, _, n = self._indices(chunk, pad=0)
            gathered = self._executable("gather", n, leaves)(leaves, pages)
            for x in gathered:
                x.copy_to_host_async()
            self._landing.append(_Landing(gathered, chunk))
        for chunk in _chunks(transfers.restores):
            pages, slots, n = self._indices(chunk, pad=self.pad)
            data = [host[slots] for host in self.tier.arrays]  # padding rows read slot 0 and are dropped
            leaves = self._executable("scatter", n, leaves)(leaves, pages, data)
            self.tier.bytes_to_device += len(chunk) * self.tier.page_bytes
        for loads in _chunks(transfers.loads):
            n = bucket_for(len(loads), COPY_BUCKETS)
            pages = np.full(n, self.pad, np.int32)
            pages[: len(loads)] = [load.page for load in loads]
            data = []
            for j, host in enumerate(self.tier.arrays):
                rows = np.zeros((n, *host.shape[1:]), host.dtype)
                rows[: len(loads)] = [load.arrays[j] for load in loads]
                data.append(rows)
            leaves = self._executable("scatter", n, leaves)(leaves, pages, data)
            self.tier.bytes_to_device += len(loads) * self.tier.page_bytes
        self.tier.copy_seconds += time.perf_counter() - t0
        return jax.tree.unflatten(self.treedef, leaves)

    def land(self) -> None:
        """Write every gathered offload into its host slots (waits for those gathers only)."""
        disk = self.tier.disk
        for item in self._landing:
            rows = [np.asarray(x) for x in item.arrays]
            for i, copy in enumerate(item.copies):
                if copy.slot >= 0:
                    for host, r in zip(self.tier.arrays, rows, strict=True):
                        host[copy.slot] = r[i]
                if disk is not None and copy.key:  # a swapped request's page (no key) is never persisted
                    disk.put(BlockHash(copy.key), [r[i] for r in rows])  # written behind, on its own thread
            self.tier.bytes_to_host += len(item.copies) * self.tier.page_bytes
        self._landing.clear()

    def _indices(self, chunk: list[SlotCopy], pad: int) -> tuple[np.ndarray, np.ndarray, int]:
        n = bucket_for(len(chunk), COPY_BUCKETS)
        pages = np.full(n, pad, np.int32)
        slots = np.zeros(n, np.int64)
        pages[: len(chunk)] = [c.page for c in chunk]
        slots[: len(chunk)] = [c.slot for c in chunk]
        return pages, slots, n

    def _executable(self, kind: str, n: int, leaves: list[jax.Array]) -> jax.stages.Compiled:
        """The copy of `kind` for `n` pages, compiled once per process for caches of this shape (replicas and
        engines of one shape share it)."""
        key = (kind, n, self.num_pages, tuple((x.shape, x.dtype, x.sharding) for x in leaves))
        exe = _COMPILED.get(key)
        if exe is None:
            pages = jax.ShapeDtypeStruct((n,), jnp.int32)
            if kind == "gather":
                exe = self._gather.lower(leaves, pages, self.num_pages).compile()
            else:
                data = [jax.ShapeDtypeStruct((n, *host.shape[1:]), host.dtype) for host in self.tier.arrays]
                exe = self._scatter.lower(leaves, pages, data, self.num_pages).compile()
            _COMPILED[key] = exe
            self.compile_count += 1
        return exe


def clear_executables() -> None:
    """Drop the compiled copies (the test suite releases each module's executables)."""
    _COMPILED.clear()


def _chunks[T](copies: list[T]) -> list[list[T]]:
    top = COPY_BUCKETS[-1]
    return [copies[i : i + top] for i in range(0, len(copies), top)]

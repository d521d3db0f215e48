"""How many KV pages does an engine get? (`kv_capacity_pages`, from the device's free memory or the CPU budget.)

An accelerator reports its free memory, and the engine takes a fraction of it. The CPU shares memory with
everything else on the machine, so the budget is set the way vLLM-CPU users expect: 4 GiB by default
(`VLLM_CPU_KVCACHE_SPACE`'s default), or what the user gives, then capped

- at half of the memory the machine has available now (so the default never pushes a small machine into
  swap), and
- at what the engine can ever hold at once: `max_num_seqs` sequences of `max_model_len` tokens (more pages
  than that only keep finished prompts for the prefix cache, and cost start-up time to allocate and zero).

The budget and the reason for it are logged at start-up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.kv_cache import KVLayout, kv_layout
from paged_jax.model.quant import kv_bytes_per_page
from paged_jax.worker.linear_state import state_pool_bytes
from pallas_kernels import kv_quant
from pallas_kernels.common import cdiv

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 2**30
AVAILABLE_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class KVBudget:
    bytes: int
    reason: str


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_budget(
    requested: int | None,
    bytes_per_token: int,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int = 1,
    available: int | None = None,
    reserved: int = 0,
) -> KVBudget:
    """The CPU KV budget: `requested` bytes (None: the 4 GiB default), capped as the module docstring says
    (`max_model_len` rounded up to whole pages, plus the null page). `reserved`: bytes of the budget spent
    elsewhere first (a hybrid's recurrent-state pool), taken off before the cap on what sequences can hold."""
    gib = 2**30
    if requested is not None:
        budget = KVBudget(requested, f"{requested / gib:.2f} GiB as requested")
    else:
        budget = KVBudget(DEFAULT_CPU_KV_CACHE_BYTES, f"the default {DEFAULT_CPU_KV_CACHE_BYTES / gib:.0f} GiB")
    available = available_memory_bytes() if available is None else available
    if available is not None and budget.bytes > available * AVAILABLE_FRACTION:
        budget = KVBudget(
            int(available * AVAILABLE_FRACTION),
            f"{budget.reason}, capped at half of the {available / gib:.1f} GiB available",
        )
    if reserved:
        budget = KVBudget(max(0, budget.bytes - reserved), f"{budget.reason}, less {reserved / gib:.2f} GiB of state")
    most = bytes_per_token * page_size * (max_num_seqs * cdiv(max_model_len, page_size) + 1)
    if budget.bytes > most:
        budget = KVBudget(
            most, f"{budget.reason}, capped at what {max_num_seqs} sequences of {max_model_len} tokens can hold"
        )
    return budget


def kv_capacity_pages(
    config: ModelConfig,
    ec: EngineConfig,
    kv_dtype,
    device: jax.Device | None = None,
    kv_shards: int = 1,
    max_model_len: int = 8192,
    memory_stats: dict[str, int] | None = None,
    platform: str | None = None,
    layout: KVLayout | None = None,
) -> int:
    """Pages that fit the KV budget: 2 x layers x tokens x kv_heads x head_dim x bytes per token (plus the
    scale rows of quantized pages, padded to whole lanes on TPU: `paged_jax.model.quant.kv_bytes_per_page`).

    A linear-attention hybrid's budget is one budget split in two: its recurrent-state pool first (fixed:
    `max_num_seqs` + 1 slots, the prefix cache's snapshot rows and speculation's checkpoint rows,
    `paged_jax.worker.linear_state.state_pool_bytes`), the rest for pages of its full-attention layers only.

    With tensor parallelism each of the `kv_shards` chips holds 1 / kv_shards of every page (of the config
    the runner uses, KV heads replicated), and the budget is that of one chip (`device`).
    `memory_stats`: `bytes_limit` and `bytes_in_use` of that chip, when it cannot be asked (a deviceless
    compile for a target, `paged_jax.worker.aot`, which names its `platform`); default: `device.memory_stats()`.
    `layout`: the KV cache groups (`engine_kv_layout`): a page is its `slots_per_page` layer slabs, and the CPU cap
    counts one page per group for each block of a sequence; None: one group of every layer.
    """
    if ec.num_pages is not None:
        return ec.num_pages
    slabs, groups = (None, 1) if layout is None else (layout.slots_per_page, len(layout.groups))
    snapshots = (ec.state_snapshots or ec.max_num_seqs) if ec.enable_prefix_caching else 0
    checkpoints = ec.max_num_seqs if ec.speculative is not None else 0  # a row per slot to restore after a rejection
    state_bytes = state_pool_bytes(config, ec.max_num_seqs, snapshots + checkpoints)
    if state_bytes:  # a linear-attention hybrid: pages only for its full-attention layers
        slabs = config.num_kv_layers
    stats = memory_stats
    if stats is None or platform is None:
        device = device or jax.local_devices()[0]
        platform = platform or device.platform
    if stats is None:
        assert device is not None  # set above
        stats = device.memory_stats() if device.platform != "cpu" else None
    per_page = kv_bytes_per_page(
        config, kv_dtype, ec.page_size, kv_shards, kv_quant.lane_dense(platform), num_slabs=slabs
    )
    if stats and "bytes_limit" in stats:
        budget = int((stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * ec.kv_cache_memory_fraction)
        budget -= state_bytes
    else:
        cpu = cpu_kv_budget(
            ec.cpu_kv_cache_bytes,
            groups * per_page // ec.page_size,
            ec.max_num_seqs,
            max_model_len,
            ec.page_size,
            reserved=state_bytes,
        )
        log.info("KV cache budget on CPU: %.2f GiB (%s; --cpu-kv-cache-gib to change)", cpu.bytes / 2**30, cpu.reason)
        budget = cpu.bytes
    if state_bytes:
        log.info(
            "recurrent-state pool: %d slots and %d snapshots x %.2f MiB = %.1f MiB of the budget, the rest for pages",
            ec.max_num_seqs + 1,
            snapshots,
            state_bytes / (ec.max_num_seqs + 1 + snapshots) / 2**20,
            state_bytes / 2**20,
        )
    return max(2, budget // per_page)


def engine_kv_layout(config: ModelConfig, ec: EngineConfig) -> KVLayout:
    """The engine's KV cache groups (`paged_jax.kv_cache.groups.kv_layout`): hybrid (a window group's tables keep
    only what its window reads) when `ec.hybrid_kv`, and for a model of several groups only when `ec.scan_layers`
    is not "off" (the grouped pages are a stacked cache's; "auto" scans a grouped model on every platform,
    `paged_jax.model.scan.use_scan`; a model whose every layer slides is one group either way); else one group of
    every layer with full-length pages."""
    layout = kv_layout(config, hybrid=ec.hybrid_kv)
    if len(layout.groups) > 1 and ec.scan_layers == "off":
        return kv_layout(config, hybrid=False)
    return layout

"""How many bytes of KV cache does an engine on the CPU get?

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


def cpu_kv_budget(requested: int | None, bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                  page_size: int = 1, available: int | None = None) -> KVBudget:
    """The CPU KV budget: `requested` bytes (None: the 4 GiB default), capped as the module docstring says
    (`max_model_len` rounded up to whole pages, plus the null page)."""
    gib = 2**30
    if requested is not None:
        budget = KVBudget(requested, f"{requested / gib:.2f} GiB as requested")
    else:
        budget = KVBudget(DEFAULT_CPU_KV_CACHE_BYTES, f"the default {DEFAULT_CPU_KV_CACHE_BYTES / gib:.0f} GiB")
    available = available_memory_bytes() if available is None else available
    if available is not None and budget.bytes > available * AVAILABLE_FRACTION:
        budget = KVBudget(int(available * AVAILABLE_FRACTION),
                          f"{budget.reason}, capped at half of the {available / gib:.1f} GiB available")
    most = bytes_per_token * page_size * (max_num_seqs * cdiv(max_model_len, page_size) + 1)
    if budget.bytes > most:
        budget = KVBudget(most, f"{budget.reason}, capped at what {max_num_seqs} sequences of {max_model_len} "
                                "tokens can hold")
    return budget

"""Swap instead of recompute: where does a preempted request's KV go, and is copying it cheaper than recomputing it?

When the scheduler must preempt a running request, its pages (every live page of every group: the full blocks and
the partial last one) can be copied into host-tier slots (`paged_jax.kv_cache.host_tier`: ``reserve``) and the
request resumes later from exactly those bytes, or its pages are freed and its context is recomputed (mostly from
the prefix cache). `SwapSpace.swap_out` chooses by the cost model (`SwapCosts.prefer_swap`): the seconds the copies
take both ways (bytes at the host <-> device rate) against the seconds its recomputation takes (its prefill FLOPs
at the device's rate, tokens other running requests keep cached on the device not counted).

A swapped request keeps everything the manager knew about it (`SwappedRequest`): which block of which group went to
which slot, its computed count, its block hashes, its window drops. ``swap_in`` allocates fresh pages, rebuilds its
block tables around them (a window group's dropped blocks stay the null page), caches its full blocks under their
keys again where no other page holds them, and records the host -> device copies; the request then continues as
if it had never stopped (the same KV bytes at the same positions: bit-exact).

Step discipline: the swap-out copies run with the step that preempted (they read the pages before anything of that
step writes them, so a freed page reused in the same step is safe) and land in the slots one step later; the
request is not admitted again in the step that preempted it (the scheduler admits nobody then), so its restores
always read landed slots. A step that schedules nothing runs no copies: its swap-outs are cancelled
(``cancel_pending``) and those requests are recomputed instead. The slots stay pinned until ``swap_in`` (released
once the restores are recorded: they read the slots when the step's copies are issued) or ``drop`` (aborted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from paged_jax.kv_cache.hashing import BlockHash
from paged_jax.kv_cache.host_tier import HostTier
from paged_jax.kv_cache.manager import KVCacheManager, RequestPages

PreemptionMode = Literal["auto", "swap", "recompute"]
PREEMPTION_MODES: tuple[str, ...] = ("auto", "swap", "recompute")


@dataclass(frozen=True, slots=True)
class SwapCosts:
    """What the cost model weighs: rates of the platform (measured at warm-up, else its configured defaults,
    `paged_jax.worker.swap_rates`) and the model's size."""

    copy_bytes_per_s: float
    """Host <-> device copy rate, each direction."""
    flops_per_s: float
    """The device's prefill rate."""
    flops_per_token: float
    """Prefill FLOPs of one token beside attention (2 x parameters)."""
    attention_flops: float
    """Attention FLOPs per token per token of context before it (4 x layers x query width)."""
    page_bytes: int
    """Bytes of one page, every slab of every cache array."""

    def swap_seconds(self, pages: int) -> float:
        """Copying ``pages`` out and back in."""
        return 2 * pages * self.page_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, tokens: int, context: int) -> float:
        """Recomputing the ``tokens`` positions at the end of a ``context``-token context."""
        start = context - tokens
        attention = self.attention_flops * (tokens * start + tokens * (tokens + 1) / 2)
        return (tokens * self.flops_per_token + attention) / self.flops_per_s

    def prefer_swap(self, pages: int, tokens: int, context: int) -> bool:
        """Whether copying ``pages`` is cheaper than recomputing ``tokens`` of a ``context``-token context."""
        return self.swap_seconds(pages) < self.recompute_seconds(tokens, context)


@dataclass(slots=True)
class SwappedRequest:
    """A swapped-out request: its live blocks' host slots and the manager's record of it, less the pages."""

    blocks: list[tuple[int, int]]
    """(group, block index) of each live page, in slot order."""
    slots: list[int]
    num_blocks: int
    """Blocks per table (the dropped ones included)."""
    num_computed: int
    block_hashes: list[BlockHash]
    num_cached_blocks: int
    extra_keys: tuple[str, ...]
    dropped: list[int]


@dataclass(slots=True)
class SwapSpace:
    """Swapped-out requests of one KV manager and the policy that decides (module docstring)."""

    kv: KVCacheManager
    tier: HostTier
    costs: SwapCosts
    mode: PreemptionMode = "auto"
    swapped: dict[str, SwappedRequest] = field(default_factory=dict)
    _this_step: list[str] = field(default_factory=list)  # swapped out by the step being scheduled

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.swapped

    def decide(self, request_id: str) -> bool:
        """Whether preempting ``request_id`` should swap it (the mode, else the cost model)."""
        if self.mode != "auto":
            return self.mode == "swap"
        state = self.kv.requests[request_id]
        pages = sum(1 for table in state.tables for page in table if page.page_id)
        shared = 0  # leading blocks another running request holds: recomputing hits them on the device
        for page in state.tables[0]:
            if page.ref_cnt < 2:
                break
            shared += 1
        tokens = max(0, state.num_computed - shared * self.kv.page_size)
        return self.costs.prefer_swap(pages, tokens, state.num_computed)

    def swap_out(self, request_id: str) -> bool:
        """Preempt ``request_id`` by copying its pages to reserved host slots and freeing them; False (nothing
        done) when the policy prefers recomputing, the request holds unsettled drafts, or the tier lacks slots."""
        kv = self.kv
        state = kv.requests[request_id]
        if state.num_draft or not self.decide(request_id):
            return False
        blocks = [(g, i) for g, table in enumerate(state.tables) for i, page in enumerate(table) if page.page_id]
        slots = self.tier.reserve(len(blocks))
        if slots is None:
            return False
        for (g, i), slot in zip(blocks, slots, strict=True):
            self.tier.swap_out(state.tables[g][i].page_id, slot)
        self.swapped[request_id] = SwappedRequest(
            blocks,
            slots,
            len(state.tables[0]),
            state.num_computed,
            list(state.block_hashes),
            state.num_cached_blocks,
            state.extra_keys,
            list(state.dropped),
        )
        self._this_step.append(request_id)
        kv.free(request_id)
        self.tier.swap_outs += 1
        return True

    def pages(self, request_id: str) -> int:
        """Device pages (all groups) swapping ``request_id`` in takes, and host -> device page copies."""
        return len(self.swapped[request_id].slots)

    def num_computed(self, request_id: str) -> int:
        return self.swapped[request_id].num_computed

    def swap_in(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Give ``request_id`` fresh pages holding its swapped KV (copied before the step reads them) and its
        block tables back; False (nothing changed) when the free pages do not suffice. ``token_ids``: the
        request's tokens, for the observer's report of the full blocks that become cache entries again."""
        kv, sw = self.kv, self.swapped[request_id]
        pool = kv.pool
        if len(sw.slots) > pool.free_queue.num_free:
            return False
        del self.swapped[request_id]
        pages = pool.allocate(len(sw.slots))
        tables = [[kv._null] * sw.num_blocks for _ in range(kv.num_groups)]
        recached: list[list[int]] = [[] for _ in range(kv.num_groups)]
        for (g, i), page, slot in zip(sw.blocks, pages, sw.slots, strict=True):
            tables[g][i] = page
            kv._group_pages[g] += 1
            self.tier.swap_in(slot, page.page_id)
            # another page may hold the key now: then this one stays uncached
            if i < sw.num_cached_blocks and pool.cache(page, kv.cache_key(sw.block_hashes[i], g)):
                recached[g].append(i)
        for g, blocks in enumerate(recached):
            kv._report_blocks(g, sw.block_hashes, token_ids, sw.extra_keys, blocks)
        self.tier.release(sw.slots)
        self.tier.swap_ins += 1
        array = kv.block_tables_array
        row = array.new_row()
        array.reserve(sw.num_blocks)
        array.array[:, row, : sw.num_blocks] = [[p.page_id for p in table] for table in tables]
        array.lengths[row] = sw.num_blocks
        kv.requests[request_id] = RequestPages(
            tables,
            sw.num_computed,
            sw.block_hashes,
            sw.num_cached_blocks,
            sw.extra_keys,
            sw.dropped,
            row,
            kv._drop_at(sw.dropped),
        )
        return True

    def drop(self, request_id: str) -> None:
        """A swapped request is aborted: its slots go back (its copies, if not taken yet, with them)."""
        sw = self.swapped.pop(request_id)
        if request_id in self._this_step:
            self._this_step.remove(request_id)
            self.tier.cancel(sw.slots)
        else:
            self.tier.release(sw.slots)

    def end_step(self, runs: bool) -> list[str]:
        """The step is decided; ``runs``: it schedules work (its copies run). A step that runs nothing cancels its
        swap-outs; returns those requests (recomputed instead)."""
        cancelled = [] if runs else self._this_step
        for request_id in cancelled:
            self.tier.cancel(self.swapped.pop(request_id).slots)
            self.tier.swap_outs -= 1
        self._this_step = []
        return cancelled

    def check(self) -> None:
        """Consistency (tests and debugging): a swapped request holds no pages, and the tier's reserved slots are
        exactly the swapped requests' slots; raises RuntimeError naming the broken invariant."""
        slots = [slot for sw in self.swapped.values() for slot in sw.slots]
        if set(self.swapped) & set(self.kv.requests):
            raise RuntimeError("swap invariant broken: a swapped request also holds device pages")
        if len(slots) != len(set(slots)) or set(slots) != self.tier.reserved:
            raise RuntimeError(
                f"swap invariant broken: swapped requests hold {len(slots)} slots, the tier reserves "
                f"{len(self.tier.reserved)}"
            )

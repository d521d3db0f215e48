"""Which adapters are loaded, and which device slot holds which? The host side of multi-LoRA serving.

`AdapterCache`: adapters read from disk, keyed by `lora_int_id`, at most `max_cpu_loras` kept for reuse in LRU
order (a request holds its own adapter, so evicting one from the cache never affects a request that has it).

`SlotTable`: the `max_loras` device slots (1..max_loras; slot 0 is "no adapter"). A sequence takes a slot when
the scheduler admits it and gives it back when it finishes or is preempted; a slot counts its users. An adapter
already resident is shared; a new one takes an empty slot, or else the least recently used slot that no running
sequence uses (its weights are overwritten: `SlotLoad`). A slot with users is never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from paged_jax.config import ModelConfig
from paged_jax.lora.peft import LoraAdapter, read_adapter
from paged_jax.lora.request import LoRARequest


@dataclass(frozen=True, slots=True)
class SlotLoad:
    """Write `adapter` into device slot `slot` before the step runs."""

    slot: int
    adapter: LoraAdapter


class AdapterCache:
    """Adapters by `lora_int_id`, read on first use and kept in LRU order (at most `max_cpu_loras`)."""

    def __init__(self, config: ModelConfig, max_rank: int, max_cpu_loras: int) -> None:
        self.config, self.max_rank, self.max_cpu_loras = config, max_rank, max_cpu_loras
        self._adapters: OrderedDict[int, tuple[LoRARequest, LoraAdapter]] = OrderedDict()
        self.num_reads = 0  # adapter directories read from disk

    def get(self, request: LoRARequest) -> LoraAdapter:
        """The adapter of `request`, read now unless cached under the same id, name and path (LoraError if it
        cannot be served)."""
        request.validate()
        hit = self._adapters.get(request.lora_int_id)
        if hit is not None and hit[0] == request:
            self._adapters.move_to_end(request.lora_int_id)
            return hit[1]
        adapter = read_adapter(request.lora_path, request.lora_name, self.config, self.max_rank)
        self.num_reads += 1
        self.put(request, adapter)
        return adapter

    def put(self, request: LoRARequest, adapter: LoraAdapter) -> None:
        """Cache `adapter`, read already for `request` (a server's start-up check of `--lora-modules`), as `get`
        would have: the first request naming it reads nothing."""
        request.validate()
        self._adapters[request.lora_int_id] = (request, adapter)
        self._adapters.move_to_end(request.lora_int_id)
        while len(self._adapters) > self.max_cpu_loras:
            self._adapters.popitem(last=False)

    def remove(self, lora_int_id: int) -> bool:
        """Forget adapter `lora_int_id` (requests holding it keep it); whether it was cached."""
        return self._adapters.pop(lora_int_id, None) is not None

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def find_digest(self, digest: str) -> tuple[int, str] | None:
        """(lora_int_id, name) of a cached adapter whose weights have `digest` (the KV events' LoRA fields)."""
        for request, adapter in self._adapters.values():
            if adapter.digest == digest:
                return request.lora_int_id, request.lora_name
        return None

    def __len__(self) -> int:
        return len(self._adapters)


class SlotTable:
    """Device slots 1..`max_loras`: which adapter (by digest) each holds and how many running sequences use it."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.digest: list[str | None] = [None] * (max_loras + 1)  # slot -> resident adapter's digest
        self.users = [0] * (max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))  # LRU, no users
        self.num_loads = 0

    def _resident(self, adapter: LoraAdapter) -> int | None:
        try:
            return self.digest.index(adapter.digest, 1)
        except ValueError:
            return None

    def can_acquire(self, adapter: LoraAdapter) -> bool:
        """Whether `acquire` would succeed now (pure)."""
        return self._resident(adapter) is not None or bool(self._idle)

    def acquire(self, adapter: LoraAdapter) -> tuple[int, SlotLoad | None]:
        """A slot for one more sequence of `adapter`, and the load to run first when it was not resident.
        Raises RuntimeError when no slot is free (callers check `can_acquire`)."""
        slot = self._resident(adapter)
        load = None
        if slot is None:
            if not self._idle:
                raise RuntimeError("no free LoRA slot: every slot is used by a running sequence")
            slot = next((s for s in self._idle if self.digest[s] is None), next(iter(self._idle)))
            self.digest[slot] = adapter.digest
            load = SlotLoad(slot, adapter)
            self.num_loads += 1
        self.users[slot] += 1
        self._idle.pop(slot, None)
        return slot, load

    def release(self, slot: int) -> None:
        """One sequence using `slot` finished or was preempted."""
        if slot == 0:
            return
        assert self.users[slot] > 0, slot
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None  # most recently used: evicted last

    def evict(self, digest: str) -> bool:
        """Forget a resident adapter whose slot has no users (the slot becomes empty); whether it was resident."""
        for s in range(1, self.max_loras + 1):
            if self.digest[s] == digest and self.users[s] == 0:
                self.digest[s] = None
                self._idle.move_to_end(s, last=False)
                return True
        return False


__all__ = ["AdapterCache", "SlotLoad", "SlotTable"]

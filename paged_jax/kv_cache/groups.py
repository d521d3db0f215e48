"""KV cache groups: which layers read their KV the same way, and how a page's memory is shared among them.

A *group* is a set of layers that read the same keys for every query: full attention (every earlier key) or a
sliding window of ``W`` tokens (keys ``x - W < p <= x`` for the query at ``x``). Every request has one block table
per group, all drawn from one page pool (one budget, as vLLM's hybrid KV cache manager does): a window group's
table drops the pages its window can no longer read while a full group's table keeps growing, so a long
sequence holds full-length pages only for its full-attention layers.

Why a shared pool and not one pool per kind (SGLang's SWA pool): one pool needs no split ratio tuned to the
workload (a ratio fixed at start-up wastes one kind's pages whenever the lengths differ from what it assumed),
and prefix caching, eviction and preemption stay one LRU and one count.

For the pool to be shared, a page must cost the same memory in every group. So every group holds at most
``slots_per_page`` layers, and a page is ``slots_per_page`` layer slabs: layer ``l`` of group ``g`` uses slab
``slot(l)`` of the pages in ``g``'s table. A kind with more layers than that is split into several groups of the
same window (Gemma 3's 29 sliding layers beside 5 global ones: five groups of 5 and one of 4, each with its own
table; the sixth group's fifth slab is unused). ``slots_per_page`` is the smallest kind's layer count, which keeps
that padding below one group per kind. A model without windows is one group holding every layer: one table, a page
of ``num_layers`` slabs, exactly the layout without groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_jax.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table per request; ``window`` None: full attention."""

    window: int | None
    """Sliding window in tokens (the query at ``x`` reads keys ``x - window < p <= x``); None: every earlier key."""
    layers: tuple[int, ...]
    """The model layers of the group, in order; layer ``layers[j]`` uses slab ``j`` of the group's pages."""


FULL = KVGroup(None, ())
"""One full-attention group, for a manager that is not told about layers (a single group of any model)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups of a model and the page geometry they share (module docstring)."""

    groups: tuple[KVGroup, ...]
    slots_per_page: int
    """Layer slabs in one page: the largest group's layer count."""

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def group_of_layer(self, num_layers: int) -> tuple[int, ...]:
        """For each layer, the index of the group holding it."""
        out = [-1] * num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = gi
        return tuple(out)

    def slot_of_layer(self, num_layers: int) -> tuple[int, ...]:
        """For each layer, its slab in the pages of its group."""
        out = [-1] * num_layers
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                out[layer] = j
        return tuple(out)


def kv_layout(config: ModelConfig, hybrid: bool = True) -> KVLayout:
    """The groups of `config`'s layers. ``hybrid=False``: one group of every layer with full-length pages (the
    baseline without window groups, for a model whose every layer slides too; the layers still attend by their
    windows, only no page leaves a table)."""
    windows = [config.layer_sliding_window(i) for i in range(config.num_layers)]
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        window = windows[0] if len(kinds) == 1 and hybrid else None
        return KVLayout((KVGroup(window, tuple(range(config.num_layers))),), config.num_layers)
    size = min(len(layers) for layers in kinds.values())
    groups: list[KVGroup] = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):  # full attention first, then by window
        layers = kinds[window]
        groups.extend(KVGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size))
    return KVLayout(tuple(groups), size)


__all__ = ["FULL", "KVGroup", "KVLayout", "kv_layout"]

"""Tensor-parallel layout of the parameters (used by `paged_jax/worker/sharding.py`).

Attention is split by heads (the fused q/k/v by KV-head groups, o on its input head axis), the MLP by the
intermediate dimension (gate/up by columns, down by rows), the embedding and LM head by vocab,
norms replicated; MoE experts like the MLP, each expert split by its intermediate dimension (the router
replicated). The TP degree must divide num_heads, intermediate and vocab, and the number of KV heads
in `params`: when it exceeds the model's KV heads, `paged_jax.worker.sharding.expand_kv_heads` first repeats them
(`sharding.kv_replication` checks all of this). Stacked layer weights (`paged_jax.model.scan`) keep their
leading layer axis whole on every chip (each chip holds its slice of every layer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from paged_jax.config import ModelConfig
from paged_jax.model.quant import QuantizedWeight
from paged_jax.model.scan import LAYERS, StackedOrder

_SPECS: dict[str, Any] = {
    "qkv_proj": lambda tp: P(None, tp, None, None),  # [H, Hkv, G + 2, D]: whole (q, k, v) groups per shard
    "qkv_bias": lambda tp: P(tp, None, None),  # [Hkv, G + 2, D]
    "o_proj": lambda tp: P(tp, None, None),  # [Hq, D, H]
    "gate_up_proj": lambda tp: P(None, None, tp),  # [H, 2, I]
    "down_proj": lambda tp: P(tp, None),  # [I, H]
    "embedding": lambda tp: P(tp, None),  # [V, H]
    "lm_head": lambda tp: P(None, tp),  # [H, V]
    "weight": lambda tp: P(),  # RMSNorm [H] (q/k norms [D])
    "router": lambda tp: P(),  # MoE router [H, E], replicated: every chip routes every token
    "experts_gate": lambda tp: P(None, None, tp),  # [E, H, I]: TP inside each expert (see paged_jax.model.moe)
    "experts_up": lambda tp: P(None, None, tp),
    "experts_down": lambda tp: P(None, tp, None),  # [E, I, H]
}


def param_partition_specs(config: ModelConfig, params: Any, tp_axis: str = "tp", order: StackedOrder = ()) -> Any:
    """A pytree like `params` ({"params": ...}) with a `PartitionSpec` per leaf; `order`: the stacked leaves'
    axis order (`paged_jax.model.scan.stacked_order`), whose specs are the per-layer ones permuted likewise."""
    del config  # the layout depends only on the leaf names; kept for the contract and later variants
    perms = dict(order)

    def spec(path: tuple[Any, ...], leaf: Any) -> Any:
        name = str(getattr(path[-1], "key", path[-1]))
        if name not in _SPECS:
            raise KeyError(f"{jax.tree_util.keystr(path)}: no partition rule")
        rule = tuple(_SPECS[name](tp_axis))
        layer = (None,) if any(getattr(k, "key", None) == LAYERS for k in path) else ()  # stacked: axis 0 whole
        moved = tuple(rule[a] for a in perms[name]) if layer and name in perms else rule
        if isinstance(leaf, QuantizedWeight):  # values as the weight; scales as its output (trailing) axes
            values, scale = P(*layer, *moved), P(*layer, *rule[leaf.contract :])
            return dataclasses.replace(leaf, values=values, scale=scale)  # type: ignore[arg-type]  # specs, not arrays
        return P(*layer, *moved)

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=lambda x: isinstance(x, QuantizedWeight))


__all__ = ["param_partition_specs"]

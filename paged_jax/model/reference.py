"""Reference greedy decoding: full recompute with `dense_attention`, the oracle for the engine.

Works for every family (`paged_jax.model.families`): the model applies its own per-layer windows and caps.

Each new token reruns the whole (padded) sequence. The buffer is padded to a power-of-two length,
and the whole loop runs inside one jitted `fori_loop`, so one (model, length, steps) compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged_jax.model.attention import DenseMeta
from paged_jax.model.init import Params


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def full_logits(model: nn.Module, params: Params, token_ids: jax.Array, length: jax.Array) -> jax.Array:
    """Logits [L, V] float32 of one sequence padded to L (tokens at index >= length are padding)."""
    num = token_ids.shape[0]
    meta = DenseMeta.single(num, length)
    hidden, _ = model.apply(params, token_ids, meta.positions, None, meta)
    return model.apply(params, hidden, method="compute_logits")  # type: ignore[return-value]  # flax types apply() as `out | (out, variables)` whatever `mutable` is


@functools.partial(jax.jit, static_argnums=(0, 4))
def _greedy(model: nn.Module, params: Params, buf: jax.Array, length: jax.Array, steps: int) -> jax.Array:
    def step(i: int, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        buf, n = carry
        logits = full_logits(model, params, buf, n)
        token = jnp.argmax(logits[n - 1]).astype(jnp.int32)
        return buf.at[n].set(token), n + 1

    buf, _ = jax.lax.fori_loop(0, steps, step, (buf, length))
    return buf


def greedy_generate(
    model: nn.Module,
    params: Params,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos: int | Sequence[int] | None = None,
    pad_to: int | None = None,
) -> list[int]:
    """The greedy continuation of `prompt_ids` (new tokens only), stopping after the first `eos` id.

    The buffer is padded to `pad_to` tokens if given (>= prompt + new tokens), else to a power of two.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids: must hold at least one token")
    if max_new_tokens <= 0:
        return []
    size = _bucket(len(prompt) + max_new_tokens) if pad_to is None else pad_to
    if size < len(prompt) + max_new_tokens:
        raise ValueError(f"pad_to: {size} is shorter than prompt + new tokens ({len(prompt) + max_new_tokens})")
    buf = jnp.zeros((size,), jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt, jnp.int32))
    out = _greedy(model, params, buf, jnp.int32(len(prompt)), max_new_tokens)
    new = [int(t) for t in jax.device_get(out)[len(prompt) : len(prompt) + max_new_tokens]]
    stops = set() if eos is None else ({eos} if isinstance(eos, int) else {int(e) for e in eos})
    for i, token in enumerate(new):
        if token in stops:
            return new[: i + 1]
    return new


__all__ = ["full_logits", "greedy_generate"]

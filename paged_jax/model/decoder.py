"""What every decoder family shares: per-layer attention, the gated MLP, the causal-LM skeleton.

A family module (`llama`, `qwen3`, `gemma`, `mixtral`, `qwen3_moe`) subclasses `CausalLM` and says how one layer is
built (`make_layer`), which RMSNorm the final norm is, and whether embeddings are scaled; everything else
(embedding, RoPE tables, the layer loop over KV caches, the final norm, tied or separate LM head, the final
logit soft cap) is here. Parameter names follow `paged_jax.model.llama` (fused qkv_proj and gate_up_proj,
o_proj, down_proj, input_layernorm, ...) so the HF import (one kernel per projection, fused at load by
`paged_jax.model.loader.fuse`), the init and the tensor-parallel specs treat every family alike.

With `scan_layers` the layers run as `jax.lax.scan`s over the stacked tree of `paged_jax.model.scan`, one per
layer group (`paged_jax.model.scan.layer_groups`: one period of the sliding-window pattern per scan step, one
layer for uniform models): each group's layer modules are traced once and applied to their layers' slices of
the stacked weights (and of the stacked LoRA slots); the KV cache is one stacked cache carried through the
scans, each layer seeing it as a `LayerPages` view. Otherwise the layers run as a Python loop over
`layers_{i}`. Both compute the same function of the same weights.

Per layer, `Attention` passes its sliding window (`ModelConfig.layer_sliding_window`) and the attention
logit soft cap to the `AttentionFn`, so both reach the paged kernels and the dense reference alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig, RopeScaling
from paged_jax.lora.delta import LoraBatch, LoraLayer, LoraLayers
from paged_jax.model import quant
from paged_jax.model.attention import AttentionFn, DenseMeta, LayerPages, dense_attention
from paged_jax.model.cpu_weights import CPU_WEIGHTS
from paged_jax.model.layers import (
    RMSNorm,
    apply_rope,
    gated_mlp,
    kernel_init,
    out_projection,
    qkv_projection,
    rope_cos_sin,
    rope_inv_freq,
)
from paged_jax.model.scan import (
    LAYERS,
    LayerGroup,
    StackedOrder,
    head_batched_qkv,
    layer_groups,
    to_layer_order,
    to_stacked_order,
)

Rope = tuple[jax.Array, jax.Array]  # cos, sin: [T, D] float32


def inv_freq_for(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """RoPE inverse frequencies [D / 2] float32: `rope_inv_freq`, plus linear scaling (every frequency / factor)."""
    if scaling is not None and scaling.rope_type == "linear":
        return (rope_inv_freq(head_dim, theta, None) / np.float32(scaling.factor)).astype(np.float32)
    return rope_inv_freq(head_dim, theta, scaling)


def weight(module: nn.Module, name: str, shape: tuple[int, ...], dtype) -> Any:
    """A module's projection weight: its packed form from the CPU-weights record where the runner packed it
    (`paged_jax.model.cpu_weights`, read by `quant.dot`), else the parameter `name` of `shape`."""
    if module.has_variable(CPU_WEIGHTS, name):
        return module.get_variable(CPU_WEIGHTS, name)
    return module.param(name, kernel_init, shape, dtype)


class Attention(nn.Module):
    """QKV projection, optional per-head q/k RMSNorm (before RoPE), RoPE, attention with this layer's sliding
    window and soft cap, output projection. Kernels as documented in `paged_jax.model.llama`; q_norm/k_norm
    weights [D]."""

    config: ModelConfig
    attention_fn: AttentionFn
    layer: int
    qk_norm: Any = None  # an RMSNorm module class (hidden_size, eps, dtype), or None for no q/k norm
    head_batched_qkv: bool = False  # the QKV matmul batched over heads (`paged_jax.model.scan.head_batched_qkv`)

    @nn.compact
    def __call__(
        self, x: jax.Array, rope: Rope, kv_cache: Any, meta: Any, lora: LoraLayer | None = None
    ) -> tuple[jax.Array, Any]:
        """x: [T, H]; `lora`: this layer's adapters for the step (None: none). Returns ([T, H], new kv_cache)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
        g = hq // hkv
        attn = {
            "qkv_proj": weight(self, "qkv_proj", (h, hkv, g + 2, d), dtype),
            "o_proj": weight(self, "o_proj", (hq, d, h), dtype),
        }
        if c.attention_bias:
            attn["qkv_bias"] = self.param("qkv_bias", nn.initializers.zeros, (hkv, g + 2, d), dtype)
        q, k, v = qkv_projection(x, attn, c, lora, self.head_batched_qkv)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.qk_norm is not None:
            q = self.qk_norm(d, c.rms_norm_eps, dtype, name="q_norm")(q)
            k = self.qk_norm(d, c.rms_norm_eps, dtype, name="k_norm")(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = self.attention_fn(
            q,
            k,
            v,
            kv_cache,
            meta,
            sm_scale=c.attn_scale,
            sliding_window=c.layer_sliding_window(self.layer),
            soft_cap=c.attn_logit_softcap,
        )
        return out_projection(out, attn, lora), kv_cache


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (`silu`) or GeGLU (`gelu_tanh`). x: [T, H] -> [T, H]; gate and up
    fused as `gate_up_proj` [H, 2, I] (one matmul, `paged_jax.model.loader.fuse`), down_proj [I, H]."""

    config: ModelConfig
    activation: str = "silu"

    @nn.compact
    def __call__(self, x: jax.Array, lora: LoraLayer | None = None) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        h, i = c.hidden_size, c.intermediate_size
        mlp = {
            "gate_up_proj": weight(self, "gate_up_proj", (h, 2, i), dtype),
            "down_proj": weight(self, "down_proj", (i, h), dtype),
        }
        return gated_mlp(x, mlp, ACTIVATIONS[self.activation], lora)


class PreNormLayer(nn.Module):
    """Llama's residual block: x + attn(norm(x)), then + mlp(norm(x)); `mlp` is a module class taking the config
    (`GatedMLP` or an MoE block), q/k norm as in `Attention`. LoRA reaches the MLP only when it has MLP arrays
    (never for MoE blocks: `paged_jax.lora.peft` refuses MLP adapters there)."""

    config: ModelConfig
    attention_fn: AttentionFn
    layer: int
    mlp: Any
    qk_norm: Any = None
    head_batched_qkv: bool = False  # as in `Attention`

    @nn.compact
    def __call__(
        self, x: jax.Array, rope: Rope, kv_cache: Any, meta: Any, lora: LoraLayer | None = None
    ) -> tuple[jax.Array, Any]:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        attn_in = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="input_layernorm")(x)
        attention = Attention(c, self.attention_fn, self.layer, self.qk_norm, self.head_batched_qkv, name="self_attn")
        attn_out, kv_cache = attention(attn_in, rope, kv_cache, meta, lora)
        x = x + attn_out
        mlp_in = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, name="post_attention_layernorm")(x)
        mlp = self.mlp(c, name="mlp")
        return x + (mlp(mlp_in, lora) if lora is not None and lora.has_mlp else mlp(mlp_in)), kv_cache


class CausalLM(nn.Module):
    """Decoder over flattened tokens of many sequences (the contract of `llama.LlamaForCausalLM`).

    Subclasses set `make_layer`, `final_norm` and `scale_embeddings`. `__call__` returns final-normed hidden
    states; `compute_logits` applies the LM head (and the final soft cap), so the engine computes logits only
    for the rows it samples from.
    """

    config: ModelConfig
    attention_fn: AttentionFn = dense_attention
    mesh: Any = None  # a jax.sharding.Mesh: MoE layers run their experts per TP shard on it (paged_jax.model.moe)
    scan_layers: bool = False  # one lax.scan over stacked layer weights (paged_jax.model.scan) instead of a loop
    stacked_order: StackedOrder = ()  # the stacked weights' axis order (paged_jax.model.scan.stacked_order)

    scale_embeddings = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the model dtype
    final_norm = RMSNorm  # the final norm's module class

    def make_layer(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def setup(self) -> None:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, embedding_init=kernel_init
        )
        self.inv_freq = inv_freq_for(c.rotary_dim, c.rope_theta, c.rope_scaling)
        local = None if c.rope_local_theta is None else inv_freq_for(c.rotary_dim, c.rope_local_theta, None)
        self.local_inv_freq = local
        if self.scan_layers:
            # Unbound layer modules (no parent), one per layer of a group (its window), each applied to one
            # layer's weights per scan step; layers differ by window alone, so any one initializes them all.
            # The layers' QKV matmul batched over heads where that reads the stacked qkv_proj in place (TPU).
            self.groups = layer_groups(c)
            batched = head_batched_qkv(self.stacked_order, c.head_dim)
            self.group_layers = [
                [self.make_layer(g.start + j).clone(parent=None, head_batched_qkv=batched) for j in range(g.size)]
                for g in self.groups
            ]
            if self.is_initializing():
                self.layers = self.param(LAYERS, self._init_stacked)
            else:  # as stored: no abstract re-run of the initializer (which also cannot check quantized leaves)
                self.layers = self.get_variable("params", LAYERS)
        else:
            self.layers = [self.make_layer(i) for i in range(c.num_layers)]
        self.norm = self.final_norm(c.hidden_size, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:
            self.lm_head = weight(self, "lm_head", (c.hidden_size, c.vocab_size), dtype)

    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        kv_caches: Sequence[Any] | Any | None,
        meta: Any,
        lora: LoraBatch | None = None,
    ) -> tuple[jax.Array, Any]:
        """token_ids, positions: [T] int32. kv_caches: one entry per layer (scanned: the one stacked cache), or
        None. `lora`: the adapter slots and each token's slot id (`paged_jax.lora.delta`); None runs the base
        model alone.

        Returns (hidden [T, H] after the final norm, new kv_caches: a list, one per layer; scanned: the stacked
        cache).
        """
        c = self.config
        x = self.embed_tokens(token_ids)  # [T, H]
        if self.scale_embeddings:
            x = x * jnp.asarray(c.hidden_size**0.5, x.dtype)
        rope = rope_cos_sin(positions, self.inv_freq)
        local = rope if self.local_inv_freq is None else rope_cos_sin(positions, self.local_inv_freq)
        layer_lora = None if lora is None else lora.layers()  # the step's token weights, once for every layer
        if self.scan_layers:
            kv = kv_caches
            for group, modules in zip(self.groups, self.group_layers, strict=True):
                x, kv = self._scan(group, modules, x, (rope, local), kv, meta, layer_lora)
            return self.norm(x), kv
        caches = [None] * c.num_layers if kv_caches is None else list(kv_caches)
        if len(caches) != c.num_layers:
            raise ValueError(f"kv_caches: expected {c.num_layers} entries (one per layer), got {len(caches)}")
        new_caches = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches, strict=True)):
            adapters = None if layer_lora is None else layer_lora.at(i)
            x, cache = layer(x, local if c.layer_sliding_window(i) is not None else rope, cache, meta, adapters)
            new_caches.append(cache)
        return self.norm(x), new_caches

    def _scan(
        self,
        group: LayerGroup,
        modules: list[nn.Module],
        x: jax.Array,
        ropes: tuple[Rope, Rope],
        kv: Any,
        meta: Any,
        layer_lora: LoraLayers | None,
    ) -> tuple[jax.Array, Any]:
        """One layer group as one scan: x [T, H], the stacked cache `kv` (or None) and the step counter g carried;
        step g applies `modules[j]` to layer l = start + g * size + j: its slice of the stacked weights (and LoRA
        slots), its `LayerPages` view of `kv`, the global or local RoPE table (`ropes`) by its window.

        Why g is carried and l computed from it: then every weight slice's index is a function of the loop's
        induction variable alone, which XLA:GPU resolves per trip and fuses into cuBLAS's operand (the dot reads
        the stacked weight in place); computed from a scanned `arange`, it was data to XLA:GPU, which copied the
        slices out before their dots (Gemma 3 4B decode: 906 MiB of temporaries). Slicing or reshaping the
        stacked arrays into a scan's `xs` instead made XLA:TPU copy them whole (16-32 GiB of temporaries on
        v5e/v6e); indexed, XLA:TPU reads them in place. `make gpu-check` and the TPU audit report both (w-copy)."""
        c = self.config

        def step(carry, _):
            g, x, kv = carry
            for j, module in enumerate(modules):
                layer = group.start + g * group.size + j
                weights = _index(self.layers, layer)
                weights = to_layer_order(weights, self.stacked_order)  # per-layer axis order
                view = None if kv is None else LayerPages(kv, layer, c.num_layers)
                rope = ropes[c.layer_sliding_window(group.start + j) is not None]
                adapters = None if layer_lora is None else layer_lora.at(layer)
                x, view = module.apply({"params": weights}, x, rope, view, meta, adapters)  # type: ignore[assignment]  # flax types apply() as `out | (out, variables)` whatever `mutable` is
                kv = None if view is None else view.pages
            return (g + 1, x, kv), None

        (_, x, kv), _ = jax.lax.scan(step, (jnp.int32(0), x, kv), length=group.count)
        return x, kv

    def _init_stacked(self, rng: jax.Array) -> Any:
        """Stacked layer weights [L, ...] from each layer's own initializer (one key per layer)."""
        c = self.config
        template = self.group_layers[0][0].clone(attention_fn=dense_attention, parent=None)  # init runs without a cache
        x = jnp.zeros((1, c.hidden_size), jnp.dtype(c.dtype))
        rope = rope_cos_sin(jnp.zeros((1,), jnp.int32), self.inv_freq)
        init = lambda key: template.init(key, x, rope, None, DenseMeta.single(1))["params"]
        return to_stacked_order(jax.vmap(init)(jax.random.split(rng, c.num_layers)), self.stacked_order)

    def compute_logits(self, hidden: jax.Array, round_to_dtype: bool = False) -> jax.Array:
        """hidden [N, H] -> logits [N, V] float32 (accumulated in float32), soft-capped when the config says so.
        `round_to_dtype`: the dot returns the model's dtype (still accumulated in float32, then rounded, as
        transformers' LM head does), widened to float32 after: the one dtype in and out that XLA's oneDNN dot
        takes (`paged_jax.worker.xla_flags`); a no-op for float32 models."""
        out = None if round_to_dtype else jnp.float32
        if self.config.tie_word_embeddings and self.has_variable(CPU_WEIGHTS, "lm_head"):  # the packed [H, V]
            logits = quant.dot(hidden, self.get_variable(CPU_WEIGHTS, "lm_head"), preferred_element_type=out)
        elif self.config.tie_word_embeddings:
            # Contract the embedding's hidden axis where it lies ([V, H], "x . E^T" without a transpose): written
            # as `hidden @ embedding.T`, XLA:CPU converted the whole bfloat16 table to float32 on every step
            # (SmolLM2-135M: 41-47 ms against 4.3 ms for this form; float32 alike either way).
            dims = (((1,), (1,)), ((), ()))
            logits = jax.lax.dot_general(hidden, self.embed_tokens.embedding, dims, preferred_element_type=out)
        else:
            logits = quant.dot(hidden, self.lm_head, preferred_element_type=out)  # lm_head [H, V]
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _index(stacked: Any, layer: jax.Array) -> Any:
    """Layer `layer`'s slice of every leaf of a stacked tree ([L, ...] -> [...]), `layer` a traced int32 scalar."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), stacked)


__all__ = ["ACTIVATIONS", "Attention", "CausalLM", "GatedMLP", "PreNormLayer", "inv_freq_for"]

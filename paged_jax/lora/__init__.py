"""Multi-LoRA serving: PEFT adapters on one base model, batched together in one step.

- `peft`: reading an adapter directory (config + safetensors) into per-layer A/B matrices, or a clear error;
- `weights`: the stacked device arrays, one slot per resident adapter (slot 0 = none);
- `delta`: the batched delta inside the projections (one executable for any mix of adapters);
- `registry`: the host side, an LRU of loaded adapters and the assignment of device slots;
- `request`: `LoRARequest`, as vLLM's.
"""

from paged_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]

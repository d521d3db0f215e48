"""Which adapter does a request run with? `LoRARequest`, named and shaped as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass

from paged_jax.errors import FieldError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter directory `lora_path` served as `lora_name`; `lora_int_id` (>= 1) identifies it in the
    engine's adapter cache (as in vLLM: a request naming a loaded id reuses it)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def validate(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise FieldError("lora_request.lora_name", "must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise FieldError("lora_request.lora_int_id", f"must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise FieldError("lora_request.lora_path", "must be a string")


__all__ = ["LoRARequest"]

"""Which adapters does a server offer by name? `ServedAdapters`: `--lora-modules name=path ...` and the runtime
load/unload endpoints, each adapter served as its own model name (as vLLM's `--lora-modules`).
`check_lora_modules` reads every `--lora-modules` adapter at start-up, so a bad one stops the start naming it
instead of failing its first request."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from paged_jax.config import ModelConfig
from paged_jax.lora.peft import LoraError, read_adapter
from paged_jax.lora.request import LoRARequest


class UnknownAdapterError(KeyError):
    """A request named an adapter this server does not serve (HTTP 404 / gRPC NOT_FOUND)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return f"the LoRA adapter {self.name!r} is not served here"


def parse_lora_modules(specs: Iterable[str]) -> list[tuple[str, str]]:
    """`name=path` strings (the `--lora-modules` values) as (name, path); ValueError naming a bad one."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: expected name=path, got {spec!r}")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


def check_lora_modules(modules: Iterable[tuple[str, str]], config: ModelConfig, max_rank: int) -> None:
    """Read every (name, path) adapter against the base model `config` and the engine's `max_rank`; ValueError
    naming the flag, the adapter and what is wrong with it (a missing path, a rank or shape that does not fit)."""
    for name, path in modules:
        try:
            read_adapter(path, name, config, max_rank)
        except LoraError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None


class ServedAdapters:
    """Adapter name -> `LoRARequest` (ids assigned in order, never reused), thread-safe: fronts resolve names on
    their own threads while the runtime endpoints add and remove them."""

    def __init__(self, modules: Iterable[tuple[str, str]] = ()) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name`; ValueError when the name is taken."""
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"lora_name: the adapter {name!r} is already loaded")
            req = self._by_name[name] = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            return req

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            if name not in self._by_name:
                raise UnknownAdapterError(name)
            return self._by_name.pop(name)

    def get(self, name: str) -> LoRARequest:
        with self._lock:
            if name not in self._by_name:
                raise UnknownAdapterError(name)
            return self._by_name[name]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._by_name


__all__ = ["ServedAdapters", "UnknownAdapterError", "check_lora_modules", "parse_lora_modules"]

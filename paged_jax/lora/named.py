"""Which adapters does a server offer by name? `ServedAdapters`: `--lora-modules name=path ...` and the runtime
load/unload endpoints, each adapter served as its own model name (as vLLM's `--lora-modules`).
`check_lora_modules` reads every `--lora-modules` adapter at start-up, so a bad one stops the start naming it
instead of failing its first request; `serve_lora_modules` then serves them with what it read in the engine's
adapter cache.

A name is a model name clients send and `/v1/models` lists, so it is kept to `NAME` (letters, digits, `._-`,
at most one `/` between two such parts, each starting with a letter or digit; at most `MAX_NAME_CHARS`): no
newline, space, `../` or 100 KB name reaches a log line or a listing. A runtime load reserves its name before
the adapter is read and adds it after (`reserve` / `add` / `release` under one lock), so of concurrent loads
of one new name exactly one succeeds and the others are told the name is taken (`AdapterNameTaken`)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping

from paged_jax.config import ModelConfig
from paged_jax.errors import FieldError, UsageError
from paged_jax.lora.peft import LoraAdapter, LoraError, read_adapter
from paged_jax.lora.registry import AdapterCache
from paged_jax.lora.request import LoRARequest

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 128
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def check_adapter_name(name: object) -> str:
    """`name` if it is a servable adapter name (see the module docstring); FieldError `lora_name` if not."""
    if not isinstance(name, str) or not name:
        raise FieldError("lora_name", "must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise FieldError("lora_name", f"{len(name)} characters, more than {MAX_NAME_CHARS}")
    if NAME.fullmatch(name) is None:
        raise FieldError(
            "lora_name",
            f"{name[:40]!r} is not a servable name: letters, digits and ._- only, at most one / between two "
            "parts, each starting with a letter or digit",
        )
    return name


class AdapterNameTaken(FieldError):
    """A load under a name already served (or being loaded right now): HTTP 409 / gRPC ALREADY_EXISTS."""

    def __init__(self, name: str) -> None:
        super().__init__("lora_name", f"{name!r} is already served (or being loaded); unload it first")


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
            raise UsageError(f"--lora-modules: expected name=path, got {spec[:200]!r}")
        try:
            check_adapter_name(name)
        except FieldError as e:
            raise UsageError(f"--lora-modules: {e.message}") from None
        if any(name == n for n, _ in out):
            raise UsageError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


def check_lora_modules(
    modules: Iterable[tuple[str, str]], config: ModelConfig, max_rank: int
) -> dict[str, LoraAdapter]:
    """Read every (name, path) adapter against the base model `config` and the engine's `max_rank`: the adapters
    by name (for `serve_lora_modules`), or UsageError (one line) naming the flag, the adapter and what is wrong
    with it (a missing path, a config that is not UTF-8 or not JSON, a rank or shape that does not fit, weights
    linked from outside its directory)."""
    read = {}
    for name, path in modules:
        try:
            adapter = read_adapter(path, name, config, max_rank)
        except LoraError as e:
            raise UsageError(f"--lora-modules {name}={path}: {e.message}") from None
        log.info("LoRA adapter %r: %s, rank %d (%s)", name, path, adapter.rank, ", ".join(adapter.target_modules))
        read[name] = adapter
    return read


def serve_lora_modules(
    served: ServedAdapters,
    modules: Iterable[tuple[str, str]],
    checked: Mapping[str, LoraAdapter] | None = None,
    cache: AdapterCache | None = None,
) -> None:
    """Serve every (name, path) of `modules` under its name; each adapter the start-up check read
    (`check_lora_modules`' `checked`) goes into the engine's adapter cache under its request, so the first
    request naming it does not read its directory again."""
    for name, path in modules:
        request = served.add(name, path)
        if cache is not None and checked is not None and name in checked:
            cache.put(request, checked[name])


class ServedAdapters:
    """Adapter name -> `LoRARequest` (ids assigned in order, never reused), thread-safe: fronts resolve names on
    their own threads while the runtime endpoints add and remove them."""

    def __init__(self, modules: Iterable[tuple[str, str]] = (), reserved: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, LoRARequest] = {}
        self._pending: set[str] = set()  # names whose load is under way
        self._reserved = frozenset(reserved)  # names never given to an adapter (the base model's)
        self._next_id = 1
        for name, path in modules:
            self.add(name, path)

    def reserve(self, name: str) -> None:
        """Hold `name` for a load about to read its adapter; AdapterNameTaken when it is served, reserved or
        already held. Follow with `add` (the load succeeded) or `release` (it failed)."""
        check_adapter_name(name)
        with self._lock:
            if name in self._by_name or name in self._pending or name in self._reserved:
                raise AdapterNameTaken(name)
            self._pending.add(name)

    def release(self, name: str) -> None:
        """Give back a name `reserve` held whose load failed."""
        with self._lock:
            self._pending.discard(name)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as `name` (held by `reserve`, or free); AdapterNameTaken when it is
        served already."""
        check_adapter_name(name)
        with self._lock:
            if name in self._by_name or name in self._reserved:
                raise AdapterNameTaken(name)
            self._pending.discard(name)
            req = self._by_name[name] = LoRARequest(name, self._next_id, path)
            self._next_id += 1
        log.info("LoRA adapter %r served from %s (id %d)", name, path, req.lora_int_id)
        return req

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            if name not in self._by_name:
                raise UnknownAdapterError(name)
            req = self._by_name.pop(name)
        log.info("LoRA adapter %r unloaded (id %d, %s)", name, req.lora_int_id, req.lora_path)
        return req

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


__all__ = [
    "AdapterNameTaken",
    "ServedAdapters",
    "UnknownAdapterError",
    "check_adapter_name",
    "check_lora_modules",
    "parse_lora_modules",
    "serve_lora_modules",
]

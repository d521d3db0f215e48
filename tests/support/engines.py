"""The one engine factory of the suite: an `LLMEngine` over a model's config and parameters with small test
defaults (a byte tokenizer, 96 pages, 8 sequences, 64-token steps, the plain-XLA attention, no warm-up), any of
which a test overrides by keyword."""

from __future__ import annotations

from typing import Any

from paged_jax.config import ModelConfig
from paged_jax.config.engine import EngineConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.tokenization.tokenizer import ByteTokenizer

DEFAULTS: dict[str, Any] = {
    "num_pages": 96,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "attention_backend": "xla",
    "warmup": False,
}


def make_engine(config: ModelConfig, params, tokenizer=None, **options: Any) -> LLMEngine:
    """An engine of `config` and `params` with `DEFAULTS` overridden by `options` (EngineConfig fields)."""
    return LLMEngine(config, params, tokenizer or ByteTokenizer(), EngineConfig(**(DEFAULTS | options)))


def run_requests(engine: LLMEngine, requests: dict[str, tuple[list[int], Any]]) -> dict[str, Any]:
    """Add each request (id -> (prompt token ids, SamplingParams)), step until none is unfinished, and return each
    request's final output (`RequestOutput`, finished) by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals

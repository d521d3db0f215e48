"""The offline API, familiar to vLLM users: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from paged_jax.engine import EngineConfig, LLMEngine
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams

Prompt = str | Mapping[str, Sequence[int]]  # text, or {"prompt_token_ids": [...]}


def prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"prompt: expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")


class LLM:
    """Load a model and generate offline with continuous batching over the paged KV cache.

    `model` is a Hugging Face directory, an orbax checkpoint written by `paged-jax convert`, or a
    config name from `configs/` (random weights from `seed`). Other keywords are `EngineConfig` fields.
    """

    def __init__(self, model: str = "tiny", *, dtype: str | None = None, seed: int = 0, **engine_options) -> None:
        from paged_jax.model.weights import load_model

        config, params, tokenizer = load_model(model, dtype=dtype, seed=seed)
        self.engine = LLMEngine(config, params, tokenizer, EngineConfig(seed=seed, **engine_options))
        self.config, self.tokenizer = config, tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Iterable[Prompt], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params: need one per prompt or a single one")
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req")
        try:  # all or nothing: an invalid prompt (or an interrupt) withdraws the ones queued before it
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, prompt_input(prompt), params)
                order[rid] = i
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def stats(self) -> dict:
        return self.engine.stats()

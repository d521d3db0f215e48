"""The offline API, familiar to vLLM users: `LLM(model=...).generate(prompts, SamplingParams(...))`,
`LLM.chat(messages, SamplingParams(...))` and `LLM.embed(prompts)`."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from tqdm.auto import tqdm

from paged_jax.config.engine import EngineConfig
from paged_jax.config.pooling import PoolerConfig
from paged_jax.engine.args import apply_model_text
from paged_jax.engine.compile_cache import use_compile_cache
from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, ProcessedRequest
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.load import load_model
from paged_jax.engine.protocol import EngineStats
from paged_jax.errors import FieldError, FieldNames
from paged_jax.lora.request import LoRARequest
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import Conversation, template_from_text
from paged_jax.tokenization.reasoning import ReplySplit, Thought, reasoning_format
from paged_jax.worker.warmup import first_use_plan

Prompt = str | Mapping[str, Sequence[int]]  # text, or {"prompt_token_ids": [...]}


def prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise FieldError("prompt_token_ids", f"must be a list of token ids, got {type(ids).__name__}")
        return list(ids)
    raise FieldError("prompt", f"expected a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")


def _is_ids(prompt: Sequence) -> bool:
    """A non-empty list of token ids (one prompt), not a list of prompts."""
    return bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class LLM:
    """Load a model and generate offline with continuous batching over the paged KV cache.

    `model` is a Hugging Face directory, an orbax checkpoint written by `paged-jax convert`, or a
    config name from `configs/` (random weights from `seed`). `chat_template` is a jinja2 file used
    instead of the model's; `generation_config` "auto" takes the sampling defaults of the model's
    `generation_config.json` (used when `sampling_params` is None), "none" turns them off. Other keywords
    are `EngineConfig` fields.

    Start-up (docs/user/startup.md): compiled step executables are kept in `$PAGED_JAX_COMPILE_CACHE`
    (default `~/.cache/paged-jax/xla`, `off`: none; `paged_jax.engine.compile_cache`), and warm-up compiles
    only what a first `generate` with the default parameters needs (`paged_jax.worker.warmup.first_use_plan`);
    every other shape compiles once, on its first use.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        dtype: str | None = None,
        seed: int = 0,
        quantization: str | None = None,
        chat_template: str | None = None,
        generation_config: str = "auto",
        **engine_options,
    ) -> None:
        t0 = time.perf_counter()
        ec = EngineConfig(seed=seed, **engine_options)
        cache = use_compile_cache(ec)
        config, params, tokenizer = load_model(
            model,
            dtype=dtype,
            seed=seed,
            quantization=quantization,
            weights_cache=None if cache is None else cache / "weights",
        )
        apply_model_text(model, tokenizer, chat_template, generation_config, ec)
        plan = first_use_plan(SamplingParams(**ec.sampling_defaults), ec.async_scheduling)
        self.engine = LLMEngine(config, params, tokenizer, ec, warmup_plan=plan)
        self.config, self.tokenizer = config, tokenizer
        self._ids = itertools.count()
        runner = self.engine.runner
        runner.show_compiles = True  # a generate call that meets a new shape says what it waits for
        if ec.warmup:
            c = runner.compile_stats
            print(
                f"paged-jax: ready in {time.perf_counter() - t0:.1f} s ({c.loaded} step executables loaded, "
                f"{c.count} compiled; other shapes compile on first use; "
                f"executable store: {ec.executable_store or 'off'})",
                file=sys.stderr,
                flush=True,
            )

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (what `sampling_params=None` uses)."""
        return SamplingParams(**self.engine.engine_config.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `lora_request` (as vLLM's): one adapter
        for every prompt or one per prompt (None: the base model); the engine needs `enable_lora=True`."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise FieldError("prompts", f"expected a prompt or a list of prompts, got {type(prompts).__name__}")
        inputs = [prompt_input(p) for p in prompts]
        return self._run(inputs, sampling_params, use_tqdm, lora_request=lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of `{"role", "content"}` messages) or to each of a list of them.

        Each conversation is rendered with the model's chat template (`chat_template`: template text used
        instead), then tokenized without adding special tokens again. On a thinking model (a template with a
        reasoning parser, `EngineConfig.reasoning_parser`) each output's `reasoning_content` holds the thought and
        its `text` the answer alone (`token_ids` keep every token). Raises ValueError naming the message
        at fault (`messages[i]...` for the i-th of several conversations), or saying how to give a template
        when the model has none.
        """
        if isinstance(messages, (str, Mapping)) or not messages:
            raise FieldError("messages", "must be a non-empty list of messages, or a list of such lists")
        if isinstance(messages[0], Mapping):  # one conversation
            conversations = [cast(Conversation, messages)]
        else:
            conversations = list(cast(Sequence[Conversation], messages))
        template = template_from_text(chat_template) if chat_template is not None else None
        if tools is not None and (isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence)):
            raise FieldError("tools", f"must be a list of tools, got {type(tools).__name__}")
        tool_list = None if tools is None else list(tools)
        chats = [
            ChatPrompt(c, add_generation_prompt, tool_list, chat_template_kwargs or {}, template) for c in conversations
        ]
        several = len(chats) > 1
        names = [FieldNames({"messages": f"messages[{i}]"}) if several else None for i in range(len(chats))]
        outs = self._run(chats, sampling_params, use_tqdm, names, lora_request)
        tokenizer = self.engine.tokenizer
        fmt = reasoning_format(template or tokenizer.chat_template, self.engine.engine_config.reasoning_parser)
        if fmt is not None:  # a thinking model: each reply's thought apart from its answer, as the servers report it
            for out in outs:
                split = ReplySplit(Thought.of(fmt, tokenizer, out.prompt_token_ids))
                for c in out.outputs:
                    c.reasoning_content, c.text = split.whole(c.text)
        return outs

    def embed(
        self,
        prompts: Prompt | Sequence[int] | Iterable[Prompt | Sequence[int]],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Embed every prompt (text, `{"prompt_token_ids": [...]}` or a list of token ids); outputs come back in
        prompt order, each with `embedding` (a list of floats) set. Each prompt runs as prefill-only steps of
        this engine (`paged_jax.pooling_params`). `pooling` ("last" | "mean"), `normalize` and `dimensions`
        (Matryoshka truncation, then renormalization) override the model's pooler (`paged_jax.config.pooling`);
        an engine whose model has none (generative only, and no `pooling=` given to `LLM`) needs `pooling`
        here. Raises FieldError naming the field."""
        pooler = self.engine.engine_config.pooler
        if pooler is None:
            if pooling is None:
                raise FieldError(
                    "pooling",
                    "the model has no pooling module (not an embedding model): pass pooling='last' or 'mean' "
                    "(here or to LLM)",
                )
            pooler = PoolerConfig(pooling)
        params = pooler.params(self.config.hidden_size, pooling, normalize, dimensions)
        one = isinstance(prompts, str | Mapping) or (isinstance(prompts, Sequence) and _is_ids(prompts))
        if not one and not isinstance(prompts, Iterable):
            raise FieldError("prompts", f"expected a prompt or a list of prompts, got {type(prompts).__name__}")
        items: list = [prompts] if one else list(prompts)
        inputs = [p if isinstance(p, str | Mapping) else {"prompt_token_ids": p} for p in items]
        processed = [self.engine.inputs.process(GenerationRequest(prompt_input(p), pooling=params)) for p in inputs]
        return self._run(processed, None, use_tqdm)

    def _run(
        self,
        prompts: Sequence[str | list[int] | ChatPrompt | ProcessedRequest],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        names: Sequence[FieldNames | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Queue every prompt (all or nothing: an invalid one, or an interrupt, withdraws the ones queued before
        it; its FieldError in `names[i]`'s words), step until all finish, return the outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise FieldError("sampling_params", "need one per prompt or a single one")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise FieldError("lora_request", "need one per prompt or a single one")
        order: dict[str, int] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), disable=not use_tqdm, desc="generate", unit="req")
        try:
            for i, (prompt, params, lora) in enumerate(zip(prompts, params_list, loras, strict=True)):
                rid = f"gen-{next(self._ids)}"
                try:
                    own = isinstance(prompt, ProcessedRequest)  # it carries its own (checked) params
                    self.engine.add_request(rid, prompt, None if own else params, lora_request=lora)
                except FieldError as e:
                    raise e.renamed(name) if names and (name := names[i]) is not None else e from None
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

    def stats(self) -> EngineStats:
        return self.engine.stats()

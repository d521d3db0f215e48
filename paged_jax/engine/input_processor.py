"""One validation path: every front's request is one `GenerationRequest`, checked and tokenized here.

`LLM`, the batch job, gRPC and the OpenAI front each turn their input into a `GenerationRequest` (a prompt
as text, token ids or a chat; the sampling fields the client set; a cache salt and request id) after
checking only what their own wire format needs (JSON types, protobuf oneofs), and `InputProcessor.process`
does every other check, once, in one order: request id and cache salt, the prompt (bounded before it is
encoded, rendered with the chat template, every id in the vocabulary), its length, the sampling fields
(the model's generation defaults fill what the request left unset; `InputLimits` bound them), and prompt +
max_tokens against the model's length.

A refusal is a `FieldError` naming the field in the engine's vocabulary: `request_id`, `cache_salt`,
`prompt` (text), `prompt_token_ids`, `messages` (`messages[i].role`, `messages[i].content`), `tools`,
`chat_template_kwargs`, `add_generation_prompt`, `chat_template`, and every `SamplingParams` field by its own
name. A front shows it in its own words with a `FieldNames` table (`paged_jax.errors`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paged_jax.errors import FieldError
from paged_jax.pooling_params import PoolingParams
from paged_jax.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputs
from paged_jax.structured.backend import Matcher
from paged_jax.tokenization.chat_template import apply_chat_template
from paged_jax.tokenization.reasoning import Thought, reasoning_format
from paged_jax.tokenization.text_checks import check_text
from paged_jax.tokenization.tokenizer import Tokenizer

MAX_CHARS_PER_TOKEN = 8  # no tokenizer makes fewer tokens than characters / 8: text is bounded before encoding
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# An embedding request's sampling: prompt only (never sampled: the engine ends it once its prompt is pooled), no text.
POOLING_SAMPLING = SamplingParams(max_tokens=0, temperature=0.0, detokenize=False)


@dataclass(slots=True)
class ChatPrompt:
    """A conversation, rendered with the model's chat template when the request is processed."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    tools: list | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    chat_template: Any = None  # a `ChatTemplate` overriding the tokenizer's (LLM.chat's `chat_template`)


@dataclass(slots=True)
class GenerationRequest:
    """One request as every front hands it to the engine.

    `sampling`: a whole `SamplingParams` (used as given), or the fields the client set by name (the
    model's generation defaults fill the others). Fields other capabilities add (structured output, LoRA
    adapters, prompt logprobs, logit bias) belong in `SamplingParams` or here, checked in `process`."""

    prompt: str | Sequence[int] | ChatPrompt
    sampling: SamplingParams | Mapping[str, Any] = field(default_factory=dict)
    request_id: str | None = None
    cache_salt: str | None = None
    pooling: PoolingParams | None = None  # an embedding request (`sampling` is then ignored: prompt only)


@dataclass(frozen=True, slots=True)
class InputLimits:
    """A server's bounds on a request (None: no bound beyond the model's). `default_max_tokens`: a server's
    max_tokens when the request and the model's defaults give none, capped by `max_tokens`, the room the
    prompt leaves and `max_request_tokens / n`; without it an unset max_tokens is `SamplingParams`' default.
    `default_chat_max_tokens`: the same for a conversation (None: `default_max_tokens`); vLLM's servers give
    a conversation the rest of the context and a plain prompt 16."""

    max_prompt_tokens: int | None = None  # None: only prompt + max_tokens is bounded; 0: the model's length - 1
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    default_chat_max_tokens: int | None = None
    max_n: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None
    max_stop_token_ids: int | None = None
    max_request_id_chars: int | None = None
    max_cache_salt_chars: int | None = None
    max_chat_messages: int | None = None  # messages in one conversation (checked before any is rendered)
    # What one client request (all its prompts, `InputProcessor.check_size`) may ask to be generated and returned:
    # prompts x n x max_tokens tokens, and logprob entries (each generated token with its alternatives, each
    # prompt token with its prompt logprob alternatives: a response holds them all).
    max_request_tokens: int | None = None
    max_logprob_entries: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A request that passed every check: its prompt as ids (and as text when it came as text)."""

    request_id: str | None
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    thought: Thought | None = None  # a thinking model's reply: its tags and where it starts (None: no reasoning)
    # Structured outputs compiled where the request was processed (a front's thread, `InputProcessor.grammars`),
    # one matcher per sample; None: the engine compiles them when the request is added.
    matchers: list[Matcher] | None = None
    pooling: PoolingParams | None = None  # an embedding request: its prompt is pooled, nothing is generated


def chat_prompt_ids(tokenizer: Tokenizer, chat: ChatPrompt, max_chars: int | None = None) -> list[int]:
    """A conversation rendered with the chat template (`chat.chat_template`, else the tokenizer's) and
    tokenized; a render longer than `max_chars` is refused before it is encoded. Raises ChatTemplateError (a
    FieldError) naming the field."""
    _, ids = apply_chat_template(
        tokenizer,
        chat.messages,
        add_generation_prompt=chat.add_generation_prompt,
        tools=chat.tools,
        chat_template=chat.chat_template,
        template_kwargs=chat.template_kwargs,
        max_chars=max_chars,
    )
    return ids


def check_message_count(count: int, limit: int | None) -> None:
    """FieldError on `messages` when a conversation has more than `limit` messages (None: no bound). The
    fronts call it too, before their own pass over the messages."""
    if limit is not None and count > limit:
        raise FieldError("messages", f"{count} messages, more than the limit of {limit}")


def sampling_params(
    sampling: SamplingParams | Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    vocab_size: int | None = None,
    max_n: int = 64,
) -> SamplingParams:
    """`sampling` as validated `SamplingParams` (a mapping: `defaults` fill the fields it leaves unset).
    Raises FieldError naming the field."""
    if isinstance(sampling, SamplingParams):
        return sampling.validate(vocab_size, max_n)
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise FieldError(unknown[0], "unknown field")
    return SamplingParams(**{**(defaults or {}), **sampling}).validate(vocab_size, max_n)


class InputProcessor:
    """Checks and tokenizes requests for one model: its tokenizer, vocabulary and length, the largest `n`
    an engine can run, the model's generation defaults, and a server's `InputLimits`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        max_n: int,
        defaults: Mapping[str, Any] | None = None,
        limits: InputLimits | None = None,
        max_logit_bias: int = MAX_LOGIT_BIAS,
        reasoning_parser: str = "auto",
        grammars: Callable[[StructuredOutputs, int], list[Matcher]] | None = None,
        hidden_size: int | None = None,
    ) -> None:
        """`grammars(spec, n)`: compile a structured-output request's matchers (its first mask included) as part
        of processing it, so that a server compiles them on the front's thread, never on the engine's (raises
        a FieldError naming the field)."""
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser  # `EngineConfig.reasoning_parser`: auto (the template's), none, a name
        self.hidden_size = hidden_size  # the model's width: the most `dimensions` an embedding may keep
        self.vocab_size, self.max_model_len, self.max_n = vocab_size, max_model_len, max_n
        self.max_logit_bias = max_logit_bias  # the engine's logit_bias width (`EngineConfig.max_logit_bias`)
        self.defaults = defaults if defaults is not None else {}  # read at each request
        self.limits = limits or InputLimits()

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt a server allows: its limit, and room for at least one generated token (None: no
        bound of its own; prompt + max_tokens is still bounded by the model's length)."""
        if self.limits.max_prompt_tokens is None:
            return None
        return min(self.limits.max_prompt_tokens or self.max_model_len, self.max_model_len - 1)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text (a text prompt, a chat's rendered text) worth encoding: more characters than
        this always make more tokens than the prompt limit (or the model's length) allows."""
        return (self.max_prompt_tokens or self.max_model_len) * MAX_CHARS_PER_TOKEN

    def process(self, req: GenerationRequest) -> ProcessedRequest:
        """Every check of one request, in order; raises FieldError naming the first field at fault."""
        lim = self.limits
        if req.request_id is not None and lim.max_request_id_chars is not None:
            if not 0 < len(req.request_id) <= lim.max_request_id_chars:
                raise FieldError("request_id", f"must have 1 to {lim.max_request_id_chars} characters")
        if req.cache_salt is not None:
            if not isinstance(req.cache_salt, str):
                raise FieldError("cache_salt", "must be a string")
            check_text(req.cache_salt, "cache_salt")  # else its KV hash fails on the engine thread
            if lim.max_cache_salt_chars is not None and len(req.cache_salt) > lim.max_cache_salt_chars:
                raise FieldError("cache_salt", f"longer than {lim.max_cache_salt_chars} characters")
        text, ids, name = self._prompt(req.prompt)
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise FieldError(
                name,
                f"the prompt has {len(ids)} tokens, more than the limit of {self.max_prompt_tokens} "
                f"(max_model_len {self.max_model_len})",
            )
        if req.pooling is not None:  # an embedding: the prompt only, pooled (`paged_jax.pooling_params`)
            if len(ids) > self.max_model_len:
                raise FieldError(
                    name, f"the input has {len(ids)} tokens, more than max_model_len ({self.max_model_len})"
                )
            pooled = req.pooling.validate(self.hidden_size or 1 << 30)
            return ProcessedRequest(req.request_id, text, ids, POOLING_SAMPLING, req.cache_salt, pooling=pooled)
        params = self._sampling(req.sampling, len(ids), chat=isinstance(req.prompt, ChatPrompt))
        if len(ids) + params.max_tokens > self.max_model_len:
            raise FieldError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
            )
        matchers = None
        if self.grammars is not None and params.structured_outputs is not None:
            matchers = self.grammars(params.structured_outputs, params.n)
        thought = self._thought(req.prompt, ids, params)
        return ProcessedRequest(req.request_id, text, ids, params, req.cache_salt, thought, matchers)

    def check_size(self, requests: Sequence[ProcessedRequest]) -> None:
        """Bound what one client request asks for across its prompts (a completions request may carry several):
        generated tokens and logprob entries (`InputLimits.max_request_tokens`, `max_logprob_entries`).
        Raises FieldError on `max_tokens` or `logprobs` naming the limit."""
        lim = self.limits
        tokens = sum(r.params.n * r.params.max_tokens for r in requests)
        if lim.max_request_tokens is not None and tokens > lim.max_request_tokens:
            first = requests[0].params
            raise FieldError(
                "max_tokens",
                f"{len(requests)} prompt(s) x n {first.n} x max_tokens {first.max_tokens} ask for {tokens} tokens, "
                f"more than the limit of {lim.max_request_tokens} per request",
            )
        entries = sum(_logprob_entries(r) for r in requests)
        if lim.max_logprob_entries is not None and entries > lim.max_logprob_entries:
            field = "logprobs" if any(r.params.logprobs for r in requests) else "prompt_logprobs"
            raise FieldError(
                field,
                f"the response would hold {entries} logprob entries (tokens x (1 + alternatives)), more than the "
                f"limit of {lim.max_logprob_entries} per request",
            )

    def _thought(self, prompt: Any, ids: list[int], params: SamplingParams) -> Thought | None:
        """The reply's thought on a model whose chat template thinks (None: no reasoning); a reasoning budget on
        any other model is refused."""
        template = prompt.chat_template if isinstance(prompt, ChatPrompt) else None
        fmt = reasoning_format(template or getattr(self.tokenizer, "chat_template", None), self.reasoning_parser)
        if fmt is None:
            if params.max_reasoning_tokens is not None:
                raise FieldError(
                    "max_reasoning_tokens",
                    "the model's chat template has no thinking section (no reasoning parser applies; "
                    "--reasoning-parser names one)",
                )
            return None
        return Thought.of(fmt, self.tokenizer, ids)

    # -- the prompt -------------------------------------------------------------------------------------
    def _prompt(self, prompt: str | Sequence[int] | ChatPrompt) -> tuple[str | None, list[int], str]:
        """(text or None, ids, the prompt's field name)."""
        limit = self.max_prompt_tokens
        if isinstance(prompt, str):
            if not prompt:
                raise FieldError("prompt", "must not be empty")
            if len(prompt) > self.max_prompt_chars:  # bound it before encoding it
                raise FieldError("prompt", f"longer than the prompt limit of {limit or self.max_model_len} tokens")
            return prompt, self.tokenizer.encode(check_text(prompt, "prompt")), "prompt"
        if isinstance(prompt, ChatPrompt):
            return None, self._chat(prompt, limit), "messages"
        if isinstance(prompt, str | bytes | Mapping) or not isinstance(prompt, Sequence | np.ndarray):
            raise FieldError("prompt_token_ids", f"must be a list of token ids, got {type(prompt).__name__}")
        ids: list[Any] = list(prompt)  # each checked by _is_token_id below
        if not ids:
            raise FieldError("prompt_token_ids", "must not be empty")
        if limit is not None and len(ids) > limit:  # bound the input before looking at every id
            raise FieldError(
                "prompt_token_ids",
                f"the prompt has {len(ids)} tokens, more than the limit of {limit} "
                f"(max_model_len {self.max_model_len})",
            )
        bad = next((t for t in ids if not _is_token_id(t, self.vocab_size)), None)
        if bad is not None:
            raise FieldError("prompt_token_ids", f"{bad!r} is not a token id in [0, {self.vocab_size})")
        return None, [int(t) for t in ids], "prompt_token_ids"

    def _chat(self, chat: ChatPrompt, limit: int | None) -> list[int]:
        """The conversation's ids: its message count bounded first, each message and the rendered text bounded
        by what the prompt limit allows before anything is encoded."""
        if isinstance(chat.messages, Sequence):
            check_message_count(len(chat.messages), self.limits.max_chat_messages)
        for i, m in enumerate(chat.messages):  # as for text: no message longer than any prompt the limit allows
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str) and len(content) > self.max_prompt_chars:
                raise FieldError(
                    f"messages[{i}].content", f"longer than the prompt limit of {limit or self.max_model_len} tokens"
                )
        return chat_prompt_ids(self.tokenizer, chat, self.max_prompt_chars)

    # -- sampling ---------------------------------------------------------------------------------------
    def _sampling(
        self, sampling: SamplingParams | Mapping[str, Any], prompt_len: int, chat: bool = False
    ) -> SamplingParams:
        lim = self.limits
        max_n = self.max_n if lim.max_n is None else min(self.max_n, lim.max_n)
        if isinstance(sampling, SamplingParams):
            return self._bounded(sampling).validate(self.vocab_size, max_n, self.max_logit_bias)
        if not isinstance(sampling, Mapping):
            raise FieldError("sampling_params", f"must be a SamplingParams, got {type(sampling).__name__}")
        fields = dict(sampling)
        unknown = sorted(set(fields) - SAMPLING_FIELDS)
        if unknown:
            raise FieldError(unknown[0], "unknown field")
        explicit = fields.get("max_tokens")
        if explicit is not None and lim.max_tokens is not None and _is_int(explicit) and explicit > lim.max_tokens:
            raise FieldError("max_tokens", f"{explicit} is above the limit of {lim.max_tokens}")
        if explicit is not None and _is_int(explicit) and explicit > self.max_model_len - prompt_len:
            raise FieldError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({explicit}) exceeds max_model_len ({self.max_model_len})",
            )
        own = (
            lim.default_chat_max_tokens if chat and lim.default_chat_max_tokens is not None else lim.default_max_tokens
        )
        if explicit is None and own is not None:
            # a server's default: the model's max_new_tokens, else its own; never past the limit, the room left,
            # or what the request's samples may generate together
            default = self.defaults.get("max_tokens", own)
            n = fields.get("n", self.defaults.get("n", 1))
            share = lim.max_request_tokens // n if lim.max_request_tokens and _is_int(n) and n > 0 else default
            fields["max_tokens"] = max(
                0, min(default, lim.max_tokens or default, self.max_model_len - prompt_len, share)
            )
        params = SamplingParams(**{**self.defaults, **fields})
        return self._bounded(params).validate(self.vocab_size, max_n, self.max_logit_bias)

    def _bounded(self, params: SamplingParams) -> SamplingParams:
        """The server's bounds on stop strings and stop ids (before `validate`'s own checks)."""
        lim = self.limits
        stop = params.stop if isinstance(params.stop, list) else []
        if lim.max_stop_strings is not None and len(stop) > lim.max_stop_strings:
            raise FieldError("stop", f"more than {lim.max_stop_strings} stop strings")
        if lim.max_stop_string_chars is not None and any(
            isinstance(s, str) and len(s) > lim.max_stop_string_chars for s in stop
        ):
            raise FieldError("stop", f"a stop string is longer than {lim.max_stop_string_chars} characters")
        ids = params.stop_token_ids if isinstance(params.stop_token_ids, list) else []
        if lim.max_stop_token_ids is not None and len(ids) > lim.max_stop_token_ids:
            raise FieldError("stop_token_ids", f"more than {lim.max_stop_token_ids} ids")
        return params


def _logprob_entries(r: ProcessedRequest) -> int:
    """Logprob entries a request's response holds: per generated token 1 + `logprobs`, per prompt token 1 +
    `prompt_logprobs` (when asked for)."""
    p, entries = r.params, 0
    if p.logprobs is not None:
        entries += p.n * p.max_tokens * (1 + p.logprobs)
    if p.prompt_logprobs is not None:
        entries += len(r.prompt_token_ids) * (1 + p.prompt_logprobs)
    return entries


def _is_token_id(t: Any, vocab_size: int) -> bool:
    return not isinstance(t, bool) and isinstance(t, (int, np.integer)) and 0 <= int(t) < vocab_size


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

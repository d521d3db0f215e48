"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Shapes as vLLM's (lm-evaluation-harness's remote tokenizer probes `/tokenizer_info` and `/tokenize`):

- `/tokenize` `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...], "add_generation_prompt": true,
  "add_special_tokens": false, "tools", "chat_template_kwargs"}` (rendered with the model's chat template, as a
  chat request would be), both with an optional `model` and `return_token_strs`, answers `{"count",
  "max_model_len", "tokens", "token_strs"}`.
- `/detokenize` `{"tokens": [ids]}` answers `{"prompt": str}` (the tokenizer's own decode, special tokens
  skipped).
- `/tokenizer_info` answers the tokenizer's special tokens, its chat template text and `model_max_length`.

A prompt is bounded (characters, ids) by the same limits as a generation's; every refusal is 400 naming the
field. The parsing lives here; `OpenAIFront.tokenize` and friends run it off the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_jax.engine.input_processor import (
    MAX_CHARS_PER_TOKEN,
    ChatPrompt,
    InputProcessor,
    chat_prompt_ids,
    check_message_count,
)
from paged_jax.tokenization.text_checks import check_text

from ..convert import invalid
from .protocol import chat_prompt, typed


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A parsed `/tokenize` body: text or a conversation, and what the answer holds."""

    prompt: str | ChatPrompt
    add_special_tokens: bool
    return_token_strs: bool
    model: str | None


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """A `/tokenize` body (a JSON object) checked for types; RequestError naming the field."""
    model = typed(body, "model", str)
    strs = bool(typed(body, "return_token_strs", bool))
    add = typed(body, "add_special_tokens", bool)
    if "messages" in body:
        if "prompt" in body:
            raise invalid("prompt: give prompt or messages, not both", "prompt")
        return TokenizeRequest(chat_prompt(body), bool(add), strs, model)  # the template writes the specials
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt: must be a string (or give messages)", "prompt")
    return TokenizeRequest(prompt, True if add is None else add, strs, model)


def tokenize(req: TokenizeRequest, inputs: InputProcessor) -> dict[str, Any]:
    """The `/tokenize` answer, bounded by the server's prompt limit before any encoding."""
    tokenizer, limit = inputs.tokenizer, inputs.max_prompt_tokens or inputs.max_model_len
    if isinstance(req.prompt, ChatPrompt):
        check_message_count(len(req.prompt.messages), inputs.limits.max_chat_messages)
        for i, m in enumerate(req.prompt.messages):
            if len(m["content"]) > limit * MAX_CHARS_PER_TOKEN:
                raise invalid(f"messages[{i}].content: longer than the prompt limit of {limit} tokens", "messages")
        ids = chat_prompt_ids(tokenizer, req.prompt, limit * MAX_CHARS_PER_TOKEN)  # a long render stops early
    else:
        if len(req.prompt) > limit * MAX_CHARS_PER_TOKEN:
            raise invalid(f"prompt: longer than the prompt limit of {limit} tokens", "prompt")
        ids = tokenizer.encode(check_text(req.prompt, "prompt"), add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": inputs.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict[str, Any], inputs: InputProcessor) -> dict[str, Any]:
    """The `/detokenize` answer; `tokens` must be ids of the vocabulary, at most max_model_len of them."""
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("tokens: must be an array of token ids", "tokens")
    if len(ids) > inputs.max_model_len:
        raise invalid(f"tokens: {len(ids)} ids, more than max_model_len ({inputs.max_model_len})", "tokens")
    bad = next((t for t in ids if not 0 <= t < inputs.vocab_size), None)
    if bad is not None:
        raise invalid(f"tokens: {bad} is not a token id in [0, {inputs.vocab_size})", "tokens")
    return {"prompt": inputs.tokenizer.decode(ids)}


def tokenizer_info(inputs: InputProcessor) -> dict[str, Any]:
    """What vLLM's `/tokenizer_info` tells a client that tokenizes on its side: special tokens, chat template."""
    tokenizer = inputs.tokenizer
    special = tokenizer.special
    template = tokenizer.chat_template
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": special.bos_token,
        "eos_token": special.eos_token,
        "pad_token": special.pad_token,
        "unk_token": special.unk_token,
        "bos_token_id": special.bos_token_id,
        "eos_token_id": special.eos_token_id,
        "pad_token_id": special.pad_token_id,
        "chat_template": template.templates.get("default") if template is not None else None,
        "model_max_length": inputs.max_model_len,
        "vocab_size": inputs.vocab_size,
    }

"""A request that leaves max_tokens unset, as vLLM's servers answer it: a conversation may use the rest of the
context (capped by --max-tokens-limit), a plain prompt gets OpenAI's 16; --default-max-tokens sets both, and the
model's own max_new_tokens comes first."""

from __future__ import annotations

import pytest

from paged_jax.config import load_model_config
from paged_jax.engine.input_processor import ChatPrompt, GenerationRequest, InputProcessor
from paged_jax.tokenization.chat_template import template_from_text
from paged_jax.tokenization.tokenizer import load_tokenizer
from serve.config import ServingLimits

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
MAX_MODEL_LEN = 256


def processor(limits: ServingLimits, defaults: dict | None = None) -> InputProcessor:
    config = load_model_config("tiny")
    tokenizer = load_tokenizer(None, config)
    tokenizer.chat_template = template_from_text(TEMPLATE, "test")
    return InputProcessor(
        tokenizer,
        vocab_size=config.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        max_n=8,
        defaults=defaults,
        limits=limits.input_limits(),
    )


CHAT = ChatPrompt(messages=[{"role": "user", "content": "Hello there"}])


def max_tokens(inputs: InputProcessor, prompt, **sampling) -> tuple[int, int]:
    """(max_tokens the request got, its prompt's length)."""
    got = inputs.process(GenerationRequest(prompt=prompt, sampling=sampling))
    return got.params.max_tokens, len(got.prompt_token_ids)


def test_a_conversation_gets_the_rest_of_the_context_and_a_prompt_16():
    inputs = processor(ServingLimits())
    tokens, prompt_len = max_tokens(inputs, CHAT)
    assert tokens == MAX_MODEL_LEN - prompt_len and prompt_len > 1
    assert max_tokens(inputs, "Once upon a time")[0] == 16
    assert max_tokens(inputs, CHAT, max_tokens=5)[0] == 5  # a request's own value is kept


def test_the_defaults_are_capped_and_overridable():
    limited = processor(ServingLimits(max_tokens=100))
    assert max_tokens(limited, CHAT)[0] == 100  # --max-tokens-limit caps the rest of the context
    shared = processor(ServingLimits(max_request_tokens=120))
    assert max_tokens(shared, CHAT, n=4)[0] == 30  # n samples share --max-request-tokens
    fixed = processor(ServingLimits(default_max_tokens=7))
    assert (max_tokens(fixed, CHAT)[0], max_tokens(fixed, "Once")[0]) == (7, 7)
    model = processor(ServingLimits(), defaults={"max_tokens": 40})  # generation_config.json's max_new_tokens
    assert (max_tokens(model, CHAT)[0], max_tokens(model, "Once")[0]) == (40, 40)


def test_a_default_above_the_limit_is_refused():
    with pytest.raises(ValueError, match=r"^default_max_tokens: must be in \[1, max_tokens \(100\)\]$"):
        ServingLimits(max_tokens=100, default_max_tokens=101).validate()

"""The offline `LLM` API under hostile input: every bad argument is a ValueError naming the field (before:
raw UnicodeEncodeError, TypeError, AttributeError and RecursionError came through), and nothing is left
queued or holding pages afterwards."""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools|tojson if tools else '' }}{{ x|default('') }}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "t.jinja"
    path.write_text(TEMPLATE)
    return LLM(
        "tiny",
        num_pages=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        attention_backend="xla",
        warmup=False,
        chat_template=str(path),
    )


def _deep(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


USER = [{"role": "user", "content": "x"}]
SP = SamplingParams(max_tokens=2)
CASES = {
    "prompt-surrogate": (lambda m: m.generate("a\ud800b", SP, use_tqdm=False), "prompt"),
    "stop-surrogate": (
        lambda m: m.generate("ab", SamplingParams(max_tokens=2, stop=["\ud800"]), use_tqdm=False),
        "stop",
    ),
    "content-surrogate": (lambda m: m.chat([{"role": "user", "content": "\udc00"}], SP, use_tqdm=False), "messages"),
    "name-surrogate": (
        lambda m: m.chat(
            [{"role": "user", "content": "x", "name": "\udc00"}],
            SP,
            use_tqdm=False,
            chat_template=("{{ messages[0].name }}"),
        ),
        "messages",
    ),
    "tools-surrogate": (lambda m: m.chat(USER, SP, use_tqdm=False, tools=[{"n": "\ud800"}]), "messages"),
    "ids-not-a-list": (lambda m: m.generate({"prompt_token_ids": 5}, SP, use_tqdm=False), "prompt_token_ids"),
    "ids-a-string": (lambda m: m.generate({"prompt_token_ids": "12"}, SP, use_tqdm=False), "prompt_token_ids"),
    "prompts-not-iterable": (lambda m: m.generate(5, SP, use_tqdm=False), "prompts"),
    "params-a-number": (lambda m: m.generate("ab", [5], use_tqdm=False), "sampling_params"),
    "deep-tools": (lambda m: m.chat(USER, SP, use_tqdm=False, tools=[{"a": _deep(100_000)}]), "messages"),
    "deep-kwargs": (
        lambda m: m.chat(USER, SP, use_tqdm=False, chat_template_kwargs={"x": _deep(100_000)}),
        "chat_template_kwargs",
    ),
    "tools-not-a-list": (lambda m: m.chat(USER, SP, use_tqdm=False, tools=5), "tools"),
    "kwargs-not-a-map": (lambda m: m.chat(USER, SP, use_tqdm=False, chat_template_kwargs=[1]), "chat_template_kwargs"),
    "kwargs-shadow": (
        lambda m: m.chat(USER, SP, use_tqdm=False, chat_template_kwargs={"range": 1}),
        "chat_template_kwargs",
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_arguments_are_value_errors_naming_the_field(llm, case) -> None:
    call, field = case
    with pytest.raises(ValueError, match=f"^{field}(\\[\\d+\\])?: "):
        call(llm)
    stats = llm.stats()
    assert stats.num_waiting == stats.num_running == 0 and stats.pages_free == stats.pages_total


def test_cache_salt_is_checked_before_the_engine_thread_hashes_it(llm) -> None:
    """A lone surrogate in a cache salt failed in the KV hash, at scheduling time (on the server: the engine loop)."""
    with pytest.raises(ValueError, match="^cache_salt: not valid Unicode"):
        llm.engine.add_request("salted", "ab", SP, cache_salt="\ud800")
    with pytest.raises(ValueError, match="^cache_salt: must be a string"):
        llm.engine.add_request("salted", "ab", SP, cache_salt=5)
    assert not llm.engine.has_unfinished()
    assert llm.generate("ab", SP, use_tqdm=False)[0].outputs[0].token_ids  # still serving

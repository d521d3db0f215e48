"""Reasoning output: the thinking families found in chat templates, where a reply starts (from its prompt), and
the split of a reply into reasoning and content, whole and streamed in every way a tag can be cut."""

from __future__ import annotations

import pytest

from paged_jax.tokenization.chat_template import render, template_from_text
from paged_jax.tokenization.reasoning import FORMATS, ReasoningStream, Thought, reasoning_format, split_reasoning
from paged_jax.tokenization.tokenizer import ByteTokenizer

# The generation prompt of Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json): the model opens the thought,
# or `enable_thinking: false` writes an empty one into the prompt.
QWEN3 = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- if m.role == 'assistant' and '</think>' in m.content %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# DeepSeek-R1's (deepseek-ai/DeepSeek-R1 since 2025-05): the generation prompt opens the thought itself.
DEEPSEEK_R1 = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{% elif m.role == 'assistant' %}{% set c = m.content %}{% if '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)
ASK = [{"role": "user", "content": "2+2?"}]
TOK = ByteTokenizer()


def _state(template: str, **kwargs) -> str:
    t = template_from_text(template)
    fmt = reasoning_format(t)
    assert fmt is not None
    text = render(t, ASK, TOK.special.template_tokens(), template_kwargs=kwargs)
    return Thought.of(fmt, TOK, TOK.encode(text, add_special_tokens=False)).state


def test_families_and_where_a_reply_starts():
    assert reasoning_format(template_from_text(QWEN3)).name == "qwen3"
    assert reasoning_format(template_from_text(DEEPSEEK_R1)).name == "deepseek_r1"
    assert reasoning_format(template_from_text("{{ messages[0].content }}")) is None
    assert reasoning_format(template_from_text(QWEN3), "none") is None
    assert reasoning_format(None, "deepseek_r1").name == "deepseek_r1"
    with pytest.raises(ValueError, match="^reasoning_parser: "):
        reasoning_format(None, "gpt-oss")
    assert _state(QWEN3) == "before"  # the model opens the thought
    assert _state(QWEN3, enable_thinking=False) == "answer"  # an empty thought is in the prompt
    assert _state(DEEPSEEK_R1) == "thinking"  # the prompt opened it


REPLIES = [
    ("before", "<think>\nLet me add.\n</think>\n\n4", "\nLet me add.\n", "\n\n4"),
    ("before", "  <think>a<b</think>c</think>", "a<b", "c</think>"),
    ("before", "<thin is not a tag", None, "<thin is not a tag"),
    ("before", "4", None, "4"),
    ("thinking", "so 4</think>4", "so 4", "4"),
    ("thinking", "cut off while thin</thi", "cut off while thin</thi", None),  # never closed: all reasoning
    ("answer", "<think>x</think>y", None, "<think>x</think>y"),
]


@pytest.mark.parametrize(("state", "text", "reasoning", "content"), REPLIES)
def test_split_whole_and_streamed_at_every_cut(state, text, reasoning, content):
    fmt = FORMATS["qwen3"]
    assert split_reasoning(fmt, state, text) == (reasoning, content)
    for i in range(len(text) + 1):  # two deltas, cut everywhere (inside the tags too)
        for j in range(i, len(text) + 1, 3):  # and three
            stream = ReasoningStream(fmt, state)
            parts = [stream.feed(text[:i]), stream.feed(text[i:j]), stream.feed(text[j:]), stream.finish()]
            r, c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
            assert (r or None, c or None) == (reasoning, content), (i, j)


def test_a_held_tag_start_goes_out_once_it_is_not_the_tag():
    stream = ReasoningStream(FORMATS["qwen3"], "thinking")
    assert stream.feed("a </th") == ("a ", "")
    assert stream.feed("e end") == ("</the end", "")
    assert stream.feed("</think>") == ("", "")
    assert stream.feed("ok") == ("", "ok")

"""Chat templates render as transformers renders them (golden texts and ids), come from the documented places,
run in jinja2's sandbox, and reject bad conversations naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged_jax.config import load_model_config
from paged_jax.tokenization.chat_template import (
    ChatTemplateError,
    apply_chat_template,
    load_chat_template,
    template_from_text,
    validate_conversation,
)
from paged_jax.tokenization.tokenizer import ByteTokenizer, load_tokenizer

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "data" / "tokenizers" / "golden.json").read_text("utf-8"))
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("name", ["phi-3", "gpt-2"])
def test_rendered_text_and_ids_equal_transformers(real_tokenizer_dir, name):
    tok = load_tokenizer(real_tokenizer_dir(name), load_model_config("tiny"))
    cases = GOLDEN["tokenizers"][name]["chat"]
    assert len(cases) >= 8
    for case in cases:
        template = None if case["template"] is None else template_from_text(GOLDEN["templates"][case["template"]])
        text, ids = apply_chat_template(
            tok,
            case["messages"],
            add_generation_prompt=case["add_generation_prompt"],
            tools=case["tools"],
            chat_template=template,
        )
        assert text == case["text"], case
        assert ids == case["ids"], case


def test_phi3_directory_template_and_its_bos(real_tokenizer_dir):
    tok = load_tokenizer(real_tokenizer_dir("phi-3"), load_model_config("tiny"))
    assert tok.chat_template.source == "chat_template.jinja"
    text, ids = apply_chat_template(tok, HELLO)
    assert text == "<s><|user|>\nHello<|end|>\n<|assistant|>\n"
    assert ids[:2] == [1, 32010] and ids.count(1) == 1  # the template's BOS only; none added on top


def test_a_model_without_a_template_names_the_option(real_tokenizer_dir):
    tok = load_tokenizer(real_tokenizer_dir("gpt-2"), load_model_config("tiny"))
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match=r"^messages: .*--chat-template FILE"):
        apply_chat_template(tok, HELLO)


def test_where_the_template_comes_from(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "default", "template": "D{{ messages[0].content }}"},
                    {"name": "tool_use", "template": "T{{ tools | length }}"},
                ]
            }
        )
    )
    named = load_chat_template(tmp_path)
    assert named.source == "tokenizer_config.json" and set(named.templates) == {"default", "tool_use"}
    tok = ByteTokenizer(chat_template=named)
    assert apply_chat_template(tok, HELLO)[0] == "DHello"
    assert apply_chat_template(tok, HELLO, tools=[{"name": "f"}])[0] == "T1"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(tmp_path).source == "chat_template.jinja"
    assert load_chat_template(tmp_path).templates["default"] == "J{{ messages | length }}"
    override = tmp_path / "mine.jinja"
    override.write_text("O")
    assert load_chat_template(tmp_path, override).source == f"--chat-template {override}"
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template(tmp_path, tmp_path / "missing.jinja")


def test_template_features_transformers_provides():
    template = template_from_text(
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.role }}]{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{{ strftime_now('%Y') | length }}{{ extra }}"
    )
    tok = ByteTokenizer(chat_template=template)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": 'héllo "x"'}]
    text, ids = apply_chat_template(tok, messages, template_kwargs={"extra": "!"})
    assert text == '[user]"héllo \\"x\\""' + ">4!"  # bos_token unset for the byte tokenizer: renders empty
    assert ids == tok.encode(text, add_special_tokens=False)
    text, _ = apply_chat_template(tok, messages, add_generation_prompt=False, template_kwargs={"extra": ""})
    assert text == '[user]"héllo \\"x\\""4'


def test_raise_exception_and_the_sandbox():
    refuse = template_from_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    tok = ByteTokenizer(chat_template=refuse)
    with pytest.raises(ChatTemplateError, match="^messages: the chat template refused .*first must be user"):
        apply_chat_template(tok, [{"role": "assistant", "content": "x"}])
    for unsafe in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        with pytest.raises(ChatTemplateError, match="^messages: the chat template refused"):
            apply_chat_template(ByteTokenizer(chat_template=template_from_text(unsafe)), HELLO)
    with pytest.raises(ChatTemplateError, match="^chat_template: not a valid jinja2 template"):
        apply_chat_template(ByteTokenizer(chat_template=template_from_text("{% for %}")), HELLO)


@pytest.mark.parametrize(
    "messages,field",
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\].role"),
        ([{"content": "a"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content"),
        ([{"role": "user"}], r"messages\[0\].content"),
        (["user: hi"], r"messages\[0\]"),
    ],
)
def test_bad_conversations_name_the_field(messages, field):
    with pytest.raises(ChatTemplateError, match=f"^{field}: "):
        validate_conversation(messages)


def test_tool_calls_may_leave_content_out():
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert validate_conversation([*HELLO, call, {"role": "tool", "content": "42"}])[1] == call

"""Chat templates: where a model's template comes from, and how it turns messages into a prompt.

Rendering follows transformers' `apply_chat_template`: jinja2's immutable sandbox (bounded in time, output and
the size of what the template builds: `template_sandbox`; `chat_template_kwargs` cannot shadow its
functions) with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and `{% generation %}` blocks, a `tojson` filter that keeps
non-ASCII text, `raise_exception(message)` and `strftime_now(format)`; the template sees `messages`,
`add_generation_prompt`, `tools`, the tokenizer's special token strings (`bos_token`, `eos_token`, ...) and
any extra variables (`template_kwargs`, vLLM's `chat_template_kwargs`). The rendered text already holds
whatever special tokens the template writes, so it is tokenized without adding special tokens again.

Where the template comes from, first found wins: an explicit file (`--chat-template FILE`), the model
directory's `chat_template.jinja`, `chat_template.json`, then `tokenizer_config.json`'s `chat_template`
(a string, or a list of named templates), plus any `chat_templates/NAME.jinja`. With named templates,
`default` is used, or `tool_use` when tools are given and the model has one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

from paged_jax.config.model_files import model_file, read_json_object, read_text
from paged_jax.errors import FieldError
from paged_jax.tokenization.template_sandbox import BoundedSandbox, RenderLimits, compile_template, render_bounded
from paged_jax.tokenization.text_checks import check_text

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
NO_TEMPLATE = "the model has no chat template; give one with --chat-template FILE (or chat_template= in LLM.chat)"

Message = Mapping[str, Any]
Conversation = Sequence[Message]


class ChatTemplateError(FieldError):
    """A conversation the template cannot render, naming the field at fault (`messages[1].role`,
    `chat_template`, `chat_template_kwargs`)."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """One model's templates by name (`default` at least) and where they came from."""

    templates: Mapping[str, str]
    source: str

    def select(self, name: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template text to use: `name` when given, else `tool_use` with tools if there is one, else default."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError("chat_template", f"no template named {name!r} (have {sorted(self.templates)})")
            return self.templates[name]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(
            "chat_template", f"several named templates and none is 'default' (have {sorted(self.templates)})"
        )


def load_chat_template(model_dir: str | Path | None, override_file: str | Path | None = None) -> ChatTemplate | None:
    """The model's chat template (see the module docstring for the order), or None when it has none."""
    if override_file is not None:
        path = Path(override_file)
        if not path.is_file():
            raise FieldError("chat_template", f"--chat-template {path} is not a file")
        return ChatTemplate({"default": read_text(path)}, f"--chat-template {path}")
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    templates: dict[str, str] = {}
    source = ""
    jinja_file, json_file = model_file(model_dir, "chat_template.jinja"), model_dir / "chat_template.json"
    if jinja_file is not None:
        templates["default"], source = read_text(jinja_file), "chat_template.jinja"
    elif isinstance(read_json_object(model_dir, json_file.name).get("chat_template"), str):
        templates["default"], source = read_json_object(model_dir, json_file.name)["chat_template"], json_file.name
    else:
        value = read_json_object(model_dir, "tokenizer_config.json").get("chat_template")
        if isinstance(value, str):
            templates["default"] = value
        elif isinstance(value, list):
            templates.update(
                {
                    t["name"]: t["template"]
                    for t in value
                    if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                }
            )
        if templates:
            source = "tokenizer_config.json"
    named_dir = model_dir / "chat_templates"
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            if (found := model_file(named_dir, path.name)) is not None:  # None: removed since the glob
                templates.setdefault(path.stem, read_text(found))
        source = source or f"{named_dir.name}/"
    return ChatTemplate(templates, source) if templates else None


def template_from_text(text: str, source: str = "chat_template argument") -> ChatTemplate:
    return ChatTemplate({"default": text}, source)


def validate_conversation(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Check a conversation's shape; return it as a list of plain dicts. Raises ChatTemplateError naming the field.

    Each message needs a `role` from `ROLES` and a string `content` (an assistant message with
    `tool_calls` may leave it out or null); any other keys pass through to the template.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(field, "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(where, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"{where}.content", "must be a string")
        out.append(dict(message))
    return out


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    """The compiled template, in the bounded sandbox (`template_sandbox`; cached: templates are long, requests many)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    class GenerationBlocks(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; here it
        renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return compile_template(env, template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError("chat_template", f"not a valid jinja2 template (line {e.lineno}: {e.message})") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError("chat_template", f"cannot be compiled ({e})") from e


def render(
    template: ChatTemplate | None,
    messages: Any,
    special_tokens: Mapping[str, str],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
    template_name: str | None = None,
    field: str = "messages",
    template_kwargs: Mapping[str, Any] | None = None,
    limits: RenderLimits | None = None,
) -> str:
    """The prompt text of one conversation. Raises ChatTemplateError naming `field` (or `chat_template`).

    `limits` bound the render (time, output and value sizes; `template_sandbox.RenderLimits`).
    """
    if template is None:
        raise ChatTemplateError(field, NO_TEMPLATE)
    if template_kwargs is not None and not (
        isinstance(template_kwargs, Mapping) and all(isinstance(k, str) for k in template_kwargs)
    ):
        raise ChatTemplateError("chat_template_kwargs", "must be an object with string keys")
    if tools is not None and (isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence)):
        raise ChatTemplateError("tools", f"must be a list, got {type(tools).__name__}")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
    if reserved:
        raise ChatTemplateError("chat_template_kwargs", f"{reserved[0]} has its own argument")
    conversation = validate_conversation(messages, field)
    compiled = _compile(template.select(template_name, tools))
    shadowed = sorted(k for k in kwargs if k in compiled.environment.globals)  # namespace, range, raise_exception...
    if shadowed:
        raise ChatTemplateError("chat_template_kwargs", f"{shadowed[0]} is a template function and cannot be set")
    variables = {
        "messages": conversation,
        "add_generation_prompt": add_generation_prompt,
        "tools": list(tools) if tools is not None else None,
        **special_tokens,
        **kwargs,
    }
    limits = limits or RenderLimits()
    try:
        return render_bounded(compiled, variables, limits)
    except jinja2.TemplateError as e:  # raise_exception(), the sandbox, a render limit, or the template's own bug
        blame = field
        if kwargs:  # the same conversation renders without them: the kwargs caused it (e.g. a bad range() bound)
            plain = {k: v for k, v in variables.items() if k not in kwargs}
            try:
                render_bounded(compiled, plain, limits)
                blame = "chat_template_kwargs"
            except jinja2.TemplateError:
                pass
        raise ChatTemplateError(blame, f"the chat template refused this conversation: {e}") from e


def apply_chat_template(
    tokenizer,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
    chat_template: ChatTemplate | None = None,
    field: str = "messages",
    template_kwargs: Mapping[str, Any] | None = None,
    max_chars: int | None = None,
) -> tuple[str, list[int]]:
    """(prompt text, prompt ids) of a conversation with the tokenizer's template (or `chat_template`).

    The ids come from `encode(text, add_special_tokens=False)`: the template wrote the special tokens. A
    rendered text longer than `max_chars` is refused while it renders (never encoded).
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    text = render(
        template,
        messages,
        tokenizer.special.template_tokens(),
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        field=field,
        template_kwargs=template_kwargs,
        limits=None if max_chars is None else RenderLimits(max_chars=max_chars),
    )
    if not text:
        raise ChatTemplateError(field, "the chat template rendered an empty prompt")
    try:
        check_text(text, field)
    except FieldError as e:  # a lone surrogate in a message (or in tools), kept by the template
        raise ChatTemplateError(e.field, e.message) from None
    return text, tokenizer.encode(text, add_special_tokens=False)


__all__ = [
    "ROLES",
    "ChatTemplate",
    "ChatTemplateError",
    "Conversation",
    "Message",
    "apply_chat_template",
    "load_chat_template",
    "render",
    "template_from_text",
    "validate_conversation",
]

"""The batch job's input line schema: one JSONL line -> a validated `BatchItem`, or a `LineError` naming the
field and carrying the line's `id` once it was read (the error line keeps it; the format is described in
`paged_jax.offline.batch`). The line is parsed with the bounds of `paged_jax.bounded_json`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from paged_jax.bounded_json import load_json
from paged_jax.engine.input_processor import ChatPrompt, sampling_params
from paged_jax.errors import FieldError
from paged_jax.sampling_params import SamplingParams, logit_bias_from_json
from paged_jax.tokenization.chat_template import validate_conversation

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


def id_key(rid: str | int) -> str:
    """The engine request id and resume key of an input id: its JSON text, so `1` and `"1"` stay apart."""
    return json.dumps(rid)


class LineError(FieldError):
    """A line refused for one of its fields once its `id` was read (None: a line whose JSON was refused before
    its id could be, which `_id_of` could not recover either): the error line keeps the id."""

    def __init__(self, field: str, message: str, rid: str | int | None) -> None:
        super().__init__(field, message)
        self.id = rid

    @classmethod
    def of(cls, e: ValueError, rid: str | int | None) -> LineError:
        """`e` (a FieldError, or a ValueError whose text is "field: message") with the line's id."""
        if isinstance(e, FieldError):
            return cls(e.field, e.message, rid)
        field, _, message = str(e).partition(": ")
        return cls(field, message, rid)


@dataclass(slots=True)
class BatchItem:
    id: str | int  # as given in the input (or "line-N")
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    cache_salt: str | None
    lineno: int
    lora: str | None = None  # the name of a served adapter (`--lora-modules`), None for the base model

    @property
    def key(self) -> str:
        return id_key(self.id)


def _parse_chat(obj: dict) -> ChatPrompt:
    messages = validate_conversation(obj.pop("messages"), "messages")
    add_prompt = obj.pop("add_generation_prompt", True)
    if not isinstance(add_prompt, bool):
        raise ValueError("add_generation_prompt: must be a boolean")
    tools = obj.pop("tools", None)
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools: must be a list")
    kwargs = obj.pop("chat_template_kwargs", None)
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs: must be an object")
    return ChatPrompt(messages, add_prompt, tools, kwargs)


def _check_unicode(obj: dict) -> None:
    """Refuse strings that cannot be written as UTF-8 (lone surrogates such as "\\ud800"), naming the field."""
    for key, value in obj.items():
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            name = key if key.isascii() else ascii(key)
            raise ValueError(f"{name}: not valid Unicode (a lone surrogate)") from None


def _id_of(line: str) -> str | int | None:
    """The `id` of a line whose JSON `load_json` refused for one of its values (an integer of thousands of
    digits, nesting past the limit): read again with every number as 0, so the error line can keep it."""
    try:
        obj = json.loads(line, parse_int=lambda _: 0, parse_float=lambda _: 0, parse_constant=lambda _: 0)
    except (ValueError, RecursionError):
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str | int) and not isinstance(rid, bool) and rid != "" else None


def parse_line(line: str | bytes, lineno: int, defaults: dict | None = None) -> BatchItem:
    """One input line -> a validated item; `defaults` fill sampling fields it leaves unset. Raises LineError
    naming the field: a LineError (with the line's id) once the id is known."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        obj = load_json(line, "body")
    except FieldError as e:
        if e.field == "body":
            raise ValueError(e.message) from None
        raise LineError(e.field, e.message, _id_of(line)) from None  # JSON, with a value past the bounds
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    _check_unicode(obj)
    rid = obj.pop("id", f"line-{lineno}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        raise ValueError(f"id: must be a non-empty string or integer, got {rid!r:.80}")
    try:
        return _item(obj, rid, lineno, defaults)
    except ValueError as e:
        raise LineError.of(e, rid) from None


def _item(obj: dict, rid: str | int, lineno: int, defaults: dict | None) -> BatchItem:
    if sum(name in obj for name in PROMPT_FIELDS) != 1:
        raise ValueError("prompt: give exactly one of 'prompt', 'prompt_token_ids' and 'messages'")
    chat_only = sorted({"add_generation_prompt", "tools", "chat_template_kwargs"} & set(obj))
    if chat_only and "messages" not in obj:
        raise ValueError(f"{chat_only[0]}: only with 'messages'")
    prompt = obj.pop("prompt", None)
    if "messages" in obj:
        prompt = _parse_chat(obj)
    elif prompt is None:
        prompt = obj.pop("prompt_token_ids")
        if not isinstance(prompt, list):
            raise ValueError("prompt_token_ids: must be a list of integers")
    elif not isinstance(prompt, str):
        raise ValueError("prompt: must be a string")
    salt = obj.pop("cache_salt", None)
    if salt is not None and not isinstance(salt, str):
        raise ValueError("cache_salt: must be a string")
    lora = obj.pop("lora", None)
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise ValueError("lora: must be the name of a served adapter (a non-empty string)")
    if "logit_bias" in obj:  # JSON object keys are strings: the token ids' text
        obj["logit_bias"] = logit_bias_from_json(obj["logit_bias"])
    return BatchItem(rid, prompt, sampling_params(obj, defaults), salt, lineno, lora)

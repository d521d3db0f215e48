"""The batch job's input line schema: one JSONL line -> a validated `BatchItem`, or a ValueError naming the
field (the format is described in `paged_jax.offline.batch`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from paged_jax.engine.input_processor import ChatPrompt, sampling_params
from paged_jax.sampling_params import SamplingParams, logit_bias_from_json
from paged_jax.tokenization.chat_template import validate_conversation

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


def id_key(rid: str | int) -> str:
    """The engine request id and resume key of an input id: its JSON text, so `1` and `"1"` stay apart."""
    return json.dumps(rid)


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


def parse_line(line: str | bytes, lineno: int, defaults: dict | None = None) -> BatchItem:
    """One input line -> a validated item; `defaults` fill sampling fields it leaves unset. Raises ValueError
    naming the field."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from e
    except RecursionError:
        raise ValueError("not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError("each line must be a JSON object")
    _check_unicode(obj)
    rid = obj.pop("id", f"line-{lineno}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
        raise ValueError(f"id: must be a non-empty string or integer, got {rid!r}")
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

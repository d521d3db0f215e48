"""Engine outputs as OpenAI response objects: completions, chat completions, their stream chunks, usage.

Plain dicts in OpenAI's documented shapes (the official client parses them into its own models).
Finish reasons: `eos`, `stop` (a stop token id) and `stop_string` are all OpenAI's `stop`; `length`
stays; `abort` (cancelled, or a server shutdown) is passed through as vLLM does. The stop string or
token id that ended a sample is vLLM's extra `stop_reason`. A chat request whose replies are parsed for tool
calls (`tool_format`) answers `tool_calls` and finish reason `tool_calls` when a reply holds calls; streamed,
the text from where a call may begin is held back (`ToolStream`) and the calls go out whole in the last delta.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_jax.outputs import CompletionOutput, RequestOutput, TokenLogprob
from paged_jax.tokenization.tool_calls import ToolCall, ToolFormat

from .protocol import Kind

FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "stop_string": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
}


@dataclass(slots=True)
class ResponseBuilder:
    """Everything one response needs besides the outputs: ids, model, and how to spell tokens."""

    kind: Kind
    request_id: str
    model: str
    tokenizer: Any
    logprobs: int | None
    tool_format: ToolFormat | None = None  # chat replies parsed for tool calls in this format
    created: int = field(default_factory=lambda: int(time.time()))
    _streams: dict[int, ToolStream] = field(default_factory=dict)  # per streamed choice, with a tool_format

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- unary --------------------------------------------------------------------------------------
    def full(self, outs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
        """The whole response; prompt i's sample j is choice i * n + j (as OpenAI numbers a batch)."""
        choices = [
            self._choice(c, c.text, c.logprobs, c.finish_reason, c.stop_reason, final=True, offset=i * n)
            for i, out in enumerate(outs)
            for c in out.outputs
        ]
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(outs),
        }

    # -- streaming ----------------------------------------------------------------------------------
    def role_chunk(self, n: int) -> dict[str, Any]:
        """The first chat chunk: each choice's role (OpenAI sends it before any content)."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ]
        return self._chunk(choices)

    def delta_chunk(self, c: CompletionOutput, offset: int = 0) -> dict[str, Any]:
        return self._chunk(
            [self._choice(c, c.new_text, c.new_logprobs, c.finish_reason, c.stop_reason, final=False, offset=offset)]
        )

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(outs)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    def _choice(
        self,
        c: CompletionOutput,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        reason: str | None,
        stop_reason: str | int | None,
        final: bool,
        offset: int,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": offset + c.index}
        if self.kind == "completion":
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(logprobs) if self.logprobs is not None else None
        else:
            key = "message" if final else "delta"
            choice[key] = {"role": "assistant", "content": text} if final else {"content": text}
            choice["logprobs"] = {"content": self._chat_logprobs(logprobs)} if self.logprobs is not None else None
            if self.tool_format is not None and self._with_tool_calls(choice[key], c, text, final, offset):
                reason = "tool_calls"
        choice["finish_reason"] = FINISH_REASONS.get(reason, reason) if reason is not None else None
        choice["stop_reason"] = stop_reason
        return choice

    def _with_tool_calls(self, msg: dict[str, Any], c: CompletionOutput, text: str, final: bool, offset: int) -> bool:
        """Put the reply's tool calls into `msg` (a message, or a stream delta); True when it has some."""
        if final:
            parsed = self.tool_format.parse(text)
            msg["content"], calls = parsed.content, parsed.tool_calls
        else:
            stream = self._streams.setdefault(offset + c.index, ToolStream(self.tool_format))
            msg["content"] = stream.feed(text)
            calls = []
            if c.finished:
                rest, calls = stream.finish()
                msg["content"] += rest
        if calls:
            msg["tool_calls"] = [_tool_call(t, None if final else k) for k, t in enumerate(calls)]
        return bool(calls)

    def _completion_logprobs(self, items: Sequence[TokenLogprob] | None) -> dict[str, Any]:
        """The legacy completions shape: parallel lists, alternatives as {token: logprob}."""
        tokens, offsets, offset = [], [], 0
        for lp in items or ():
            tokens.append(self.token_text(lp.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items or ()],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in items or ()],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, items: Sequence[TokenLogprob] | None) -> list[dict[str, Any]]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items or ()
        ]


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Token counts summed over the request's prompts (and their samples)."""
    prompt = sum(o.metrics.num_prompt_tokens for o in outs)
    completion = sum(o.metrics.num_generated_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.metrics.num_cached_prompt_tokens for o in outs)},
    }


def _tool_call(call: ToolCall, index: int | None) -> dict[str, Any]:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


class ToolStream:
    """One streamed choice's text: content is passed on up to where a tool call may begin, the rest is held
    until the reply ends and is parsed then."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.text, self.sent = fmt, "", 0

    def feed(self, new: str) -> str:
        """The content that can go out now, given `new` text."""
        self.text += new
        hold = self.fmt.may_start(self.text)
        limit = len(self.text) if hold is None else hold
        out = self.text[self.sent : limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the held-back content, the calls) once the reply ended."""
        parsed = self.fmt.parse(self.text)
        if parsed.tool_calls:
            return "", parsed.tool_calls
        return self.text[self.sent :], []

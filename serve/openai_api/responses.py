"""Engine outputs as OpenAI response objects: completions, chat completions, their stream chunks, usage.

Plain dicts in OpenAI's documented shapes (the official client parses them into its own models).
Finish reasons: `eos`, `stop` (a stop token id) and `stop_string` are all OpenAI's `stop`; `length`
stays; `abort` (cancelled, or a server shutdown) is passed through as vLLM does. The stop string or
token id that ended a sample is vLLM's extra `stop_reason`. A chat request whose replies are parsed for tool
calls (`tool_format`) answers `tool_calls` and finish reason `tool_calls` when a reply holds calls; streamed,
the text from where a call may begin is held back (`ToolStream`), never sent as content: each call goes out as a
chunk with its index, id and name, then chunks with pieces of its arguments as they are written (`delta_chunks`:
one call piece per chunk).
Completions with `echo` (vLLM's behaviour, which lm-evaluation-harness reads): each choice's text, and with
`logprobs` its legacy logprobs, cover the prompt and then the completion, the first prompt token's logprob and
alternatives null; `max_tokens: 0` leaves the prompt alone. Streamed, a choice's first chunk carries the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_jax.outputs import CompletionOutput, RequestOutput, TokenLogprob
from paged_jax.tokenization.reasoning import ReplySplit, Thought
from paged_jax.tokenization.tool_calls import CallProgress, ToolCall, ToolFormat

from .protocol import Kind

FINISH_REASONS = {
    "eos": "stop",
    "stop": "stop",
    "stop_string": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
}


LOGPROB_FLOOR = -9999.0  # what vLLM sends for a logprob of -inf (JSON has no infinity)


@dataclass(slots=True)
class Echo:
    """One prompt as an echoing completions response repeats it in front of each of its choices: its text (a
    token-id prompt's decoded), its ids, and the engine's prompt logprobs once its first output brings them."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class ResponseBuilder:
    """Everything one response needs besides the outputs: ids, model, and how to spell tokens.

    `echo` (completions, one per prompt): the prompts to repeat; `prompt_logprobs`: vLLM's extra was asked
    for with this many alternatives (each choice gets `prompt_logprobs`, chat's response gets one)."""

    kind: Kind
    request_id: str
    model: str
    tokenizer: Any
    logprobs: int | None
    tool_format: ToolFormat | None = None  # chat replies parsed for tool calls in this format
    thought: Thought | None = None  # chat replies of a thinking model: split into reasoning_content and content
    echo: list[Echo] | None = None
    prompt_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _streams: dict[int, ToolStream] = field(default_factory=dict)  # per streamed choice, with a tool_format
    _split: ReplySplit | None = None  # with a thought: each choice's reasoning apart from its content
    _text_offsets: dict[int, int] = field(default_factory=dict)  # per streamed choice: text_offset so far

    @property
    def object_name(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- unary --------------------------------------------------------------------------------------
    def full(self, outs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
        """The whole response; prompt i's sample j is choice i * n + j (as OpenAI numbers a batch)."""
        choices = []
        for i, out in enumerate(outs):
            self.seen(i, out)
            for c in out.outputs:
                choice = self._choice(
                    c, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, True, i * n, i
                )
                if self.kind == "completion" and self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out)
                choices.append(choice)
        response = {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(outs),
        }
        if self.kind == "chat" and self.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.vllm_prompt_logprobs(outs[0])
        return response

    def seen(self, prompt: int, out: RequestOutput) -> None:
        """Note what an output of prompt `prompt` brings that later chunks need (its prompt logprobs)."""
        if self.echo is not None and out.prompt_logprobs is not None:
            self.echo[prompt].logprobs = out.prompt_logprobs

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} holding the token itself and its top alternatives. A rank the engine does not report (a
        prompt token outside its top alternatives) is null, as vLLM's `Logprob.rank` may be."""
        if out.prompt_logprobs is None:
            return None
        k = self.prompt_logprobs or 0
        result: list[dict[str, dict[str, Any]] | None] = []
        for entry in out.prompt_logprobs:
            if entry is None:
                result.append(None)
                continue
            tops = entry.top[:k]
            ranks = {t: r for r, (t, _) in enumerate(tops, 1)}
            items = {entry.token_id: (entry.logprob, ranks.get(entry.token_id))}
            for r, (t, v) in enumerate(tops, 1):
                items.setdefault(t, (v, r))
            result.append(
                {
                    str(t): {"logprob": max(v, LOGPROB_FLOOR), "rank": r, "decoded_token": self.token_text(t)}
                    for t, (v, r) in items.items()
                }
            )
        return result

    # -- streaming ----------------------------------------------------------------------------------
    def role_chunk(self, n: int) -> dict[str, Any]:
        """The first chat chunk: each choice's role (OpenAI sends it before any content)."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ]
        return self._chunk(choices)

    def delta_chunk(self, c: CompletionOutput, offset: int = 0, prompt: int = 0) -> dict[str, Any]:
        """The chunk of what one step added to a sample of prompt `prompt` (choice `offset + c.index`); with
        echo, a choice's first chunk starts with the prompt."""
        return self._chunk(
            [
                self._choice(
                    c,
                    c.new_text,
                    c.new_token_ids,
                    c.new_logprobs,
                    c.finish_reason,
                    c.stop_reason,
                    final=False,
                    offset=offset,
                    prompt=prompt,
                )
            ]
        )

    def delta_chunks(self, c: CompletionOutput, offset: int = 0, prompt: int = 0) -> list[dict[str, Any]]:
        """`delta_chunk`, with the tool calls it completes sent as OpenAI streams them: a chunk with each new
        call's index, id and name (and the delta's content), then one with their arguments (and the finish)."""
        chunk = self.delta_chunk(c, offset, prompt)
        choice = chunk["choices"][0]
        pieces = choice.get("delta", {}).get("tool_calls")
        if not pieces:
            return [chunk]
        first = {**choice, "delta": {**choice["delta"], "tool_calls": pieces[:1]}}
        chunks = [{**first, "finish_reason": None, "stop_reason": None} if len(pieces) > 1 else first]
        for k, piece in enumerate(pieces[1:], 2):
            rest = {**choice, "delta": {"tool_calls": [piece]}, "logprobs": None}
            chunks.append(rest if k == len(pieces) else {**rest, "finish_reason": None, "stop_reason": None})
        return [self._chunk([c]) for c in chunks]

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(outs)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.request_id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    def _choice(
        self,
        c: CompletionOutput,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None,
        reason: str | None,
        stop_reason: str | int | None,
        final: bool,
        offset: int,
        prompt: int,
    ) -> dict[str, Any]:
        """Choice `offset + c.index` (of prompt `prompt`): the delta of a stream, or the whole of a response."""
        index = offset + c.index
        choice: dict[str, Any] = {"index": index}
        if self.kind == "completion":
            ids: list[int] = list(token_ids)
            entries: list[TokenLogprob | None] = list(logprobs) if logprobs else [None] * len(ids)
            start = 0 if final else self._text_offsets.get(index, 0)
            if self.echo is not None and (final or index not in self._text_offsets):  # the prompt goes first, once
                echo = self.echo[prompt]
                text = echo.text + text
                ids = echo.token_ids + ids
                entries = list(echo.logprobs or [None] * len(echo.token_ids)) + entries
            choice["text"] = text
            if self.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs(ids, entries, start)
                if not final:
                    self._text_offsets[index] = start + sum(len(t) for t in choice["logprobs"]["tokens"])
            else:
                choice["logprobs"] = None
                if not final:
                    self._text_offsets[index] = start + len(text)
        else:
            key = "message" if final else "delta"
            reasoning, text = self._reasoning(c, text, final, offset)
            content = text if text or reasoning is None else None  # beside reasoning, no answer is null
            choice[key] = {"role": "assistant", "content": content} if final else {"content": text}
            if reasoning is not None and (final or reasoning):
                choice[key]["reasoning_content"] = reasoning or None
            choice["logprobs"] = {"content": self._chat_logprobs(logprobs)} if self.logprobs is not None else None
            if self.tool_format is not None and self._with_tool_calls(choice[key], c, text, final, offset):
                reason = "tool_calls"
        choice["finish_reason"] = FINISH_REASONS.get(reason, reason) if reason is not None else None
        choice["stop_reason"] = stop_reason
        return choice

    def _reasoning(self, c: CompletionOutput, text: str, final: bool, offset: int) -> tuple[str | None, str]:
        """(the reasoning, the content) of a reply or of a stream's delta; reasoning None without a thought.
        A whole reply without content answers content null beside its reasoning."""
        if self.thought is None:
            return None, text
        if self._split is None:
            self._split = ReplySplit(self.thought)
        return self._split.whole(text) if final else self._split.delta(offset + c.index, text, c.finished)

    def _with_tool_calls(self, msg: dict[str, Any], c: CompletionOutput, text: str, final: bool, offset: int) -> bool:
        """Put the reply's tool calls into `msg` (a message, or a stream delta); True when it has some."""
        assert self.tool_format is not None  # called for requests with tools only
        if final:
            parsed = self.tool_format.parse(text)
            msg["content"], calls = parsed.content, parsed.tool_calls
        else:
            stream = self._streams.setdefault(offset + c.index, ToolStream(self.tool_format))
            msg["content"], fresh = stream.feed(text)
            if c.finished:
                rest, more = stream.finish()
                msg["content"] += rest
                fresh += more
            if fresh:
                msg["tool_calls"] = [_tool_delta(d) for d in fresh]
            return c.finished and bool(stream.emitted)  # the finish reason, on the last delta
        if calls:
            msg["tool_calls"] = [_tool_call(t, None) for t in calls]
        return bool(calls)

    def _completion_logprobs(
        self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], start: int
    ) -> dict[str, Any]:
        """The legacy completions shape (as vLLM's): parallel lists over `ids`, an entry of None (the first prompt
        token) giving null logprob and alternatives; alternatives as {token: logprob} holding the token itself
        and the `logprobs` most likely; `text_offset` the running length of the token strings from `start`."""
        k = self.logprobs or 0
        tokens: list[str] = []
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offset = start
        for token_id, lp in zip(ids, entries, strict=True):
            tokens.append(self.token_text(token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
            if lp is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            logprob = max(lp.logprob, LOGPROB_FLOOR)
            token_logprobs.append(logprob)
            top = {tokens[-1]: logprob}
            for t, v in lp.top[:k]:
                top.setdefault(self.token_text(t), max(v, LOGPROB_FLOOR))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

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


def _tool_delta(d: ToolDelta) -> dict[str, Any]:
    """A streamed call piece as OpenAI sends it: the head with index, id, type and name (arguments ""), then
    index and arguments pieces."""
    if d.call is not None:
        return _tool_call(d.call, d.index)
    return {"index": d.index, "function": {"arguments": d.arguments}}


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """One piece of a streamed call: its head (`call`, sent first: index, id and name) or a piece of its
    arguments text (`arguments`)."""

    index: int
    call: ToolCall | None = None
    arguments: str = ""


class ToolStream:
    """One streamed choice's text: content is passed on up to where a tool call may begin; from there the text is
    held, each call's head goes out once its name and the start of its arguments are known, and its arguments
    follow in pieces as the model writes them (`ToolFormat.progress`: the text so far only grows, so the pieces
    join to what `parse` reads from the whole reply). What is held when the reply ends is parsed whole: the
    rest of the calls, and the content between and after them. A call cut off (the reply ended inside it) keeps
    what was sent, and no more content follows (unary, such a reply has no complete call: it is all content)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.text, self.sent = fmt, "", 0
        self.emitted: list[ToolCall] = []  # the calls whose heads were sent, in order (their ids are kept)
        self._args: list[str] = []  # per call: its arguments text sent so far

    def feed(self, new: str) -> tuple[str, list[ToolDelta]]:
        """(the content that can go out now, the call pieces new now), given `new` text."""
        self.text += new
        hold = self.fmt.may_start(self.text)
        limit = len(self.text) if hold is None else hold
        out = self.text[self.sent : limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out, self._deltas(self.fmt.progress(self.text[self.sent :]) if new else [])

    def finish(self) -> tuple[str, list[ToolDelta]]:
        """(the held-back content, the call pieces not sent yet) once the reply ended."""
        parsed = self.fmt.parse(self.text[self.sent :])
        if len(self.emitted) > len(parsed.tool_calls):  # cut off inside a call: the held text is the calls'
            return "", []
        if parsed.tool_calls:
            done = [CallProgress(c.name, c.arguments, True) for c in parsed.tool_calls]
            return parsed.content or "", self._deltas(done)
        return self.text[self.sent :], []

    def _deltas(self, calls: list[CallProgress]) -> list[ToolDelta]:
        out = []
        for k, p in enumerate(calls):
            if k == len(self.emitted):
                self.emitted.append(ToolCall(p.name, ""))
                self._args.append("")
                out.append(ToolDelta(k, call=self.emitted[k]))
            sent = self._args[k]
            if len(p.arguments) > len(sent) and p.arguments.startswith(sent):
                out.append(ToolDelta(k, arguments=p.arguments[len(sent) :]))
                self._args[k] = p.arguments
        return out

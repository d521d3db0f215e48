"""Reasoning output: which thinking syntax a chat template uses, where a reply's thought is, and how a streamed
reply splits into `reasoning_content` and `content`.

A format belongs to a chat-template family, found in the template's text (or named by `--reasoning-parser`):
- `qwen3` (Qwen3, Qwen3.5, QwQ) and `deepseek_r1` (DeepSeek-R1 and its distills): the thought is
  `<think>...</think>` before the answer. Qwen3's generation prompt leaves the model to open the tag (or, with
  `chat_template_kwargs: {"enable_thinking": false}`, writes an empty closed thought into the prompt);
  DeepSeek-R1's and Qwen3.5's open it in the prompt, so the reply starts inside the thought.
The two families differ only in their prompts, so where a reply starts is read from the prompt itself
(`Thought.of`): inside an open thought, after a closed one (no reasoning), or before one the model may open.

Parsing is the same whole or streamed (`ReasoningStream`; a whole reply is one feed): a tag split across
tokens or deltas is held back until it is known to be (or not to be) the tag; a thought never closed (the
reply hit its length) is all reasoning. The answer's text is passed on unchanged (tool calls and structured
output read it alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from paged_jax.config.engine import REASONING_PARSERS
from paged_jax.tokenization.chat_template import ChatTemplate

State = Literal["before", "thinking", "answer"]  # where a reply starts, or where a stream is


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One family's thought tags."""

    name: str
    start: str = "<think>"
    end: str = "</think>"


FORMATS: dict[str, ReasoningFormat] = {name: ReasoningFormat(name) for name in ("qwen3", "deepseek_r1")}
assert set(REASONING_PARSERS) == {"auto", "none", *FORMATS}  # the flag's choices are these formats


def reasoning_format(template: ChatTemplate | None, parser: str = "auto") -> ReasoningFormat | None:
    """The reasoning format of a chat template's family (`parser` "auto"), or the one `parser` names ("none":
    none). DeepSeek-R1's templates say `<｜Assistant｜>`; every other thinking template is Qwen3's."""
    if parser != "auto":
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser: {parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        return FORMATS.get(parser)
    if template is None:
        return None
    text = "\n".join(template.templates.values())
    if "</think>" not in text:
        return None
    return FORMATS["deepseek_r1" if "<｜Assistant｜>" in text else "qwen3"]


def _last(ids: Sequence[int], sub: Sequence[int]) -> int:
    """The index of the last occurrence of `sub` in `ids` (-1: none)."""
    n = len(sub)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i : i + n]) == list(sub):
            return i
    return -1


@dataclass(frozen=True, slots=True)
class Thought:
    """A request's thought: the format, its tags as the model's token ids, and where the reply starts."""

    fmt: ReasoningFormat
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    state: State

    @classmethod
    def of(cls, fmt: ReasoningFormat, tokenizer, prompt_ids: Sequence[int]) -> Thought:
        """Where a reply to `prompt_ids` starts: "thinking" when the prompt's last start tag is not closed,
        "answer" when the prompt ends with a closed thought (only whitespace after its end tag), else "before"
        (the model may open one)."""
        start = tuple(tokenizer.encode(fmt.start, add_special_tokens=False))
        end = tuple(tokenizer.encode(fmt.end, add_special_tokens=False))
        tail = list(prompt_ids[-4096:])  # a generation prompt opens or closes its thought at its very end
        s, e = _last(tail, start), _last(tail, end)
        state: State = "before"
        if s > e:
            state = "thinking"
        elif e >= 0 and not tokenizer.decode(tail[e + len(end) :], skip_special_tokens=False).strip():
            state = "answer"
        return cls(fmt, start, end, state)


def _held(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back: it may be the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class ReasoningStream:
    """One reply's text, fed as it arrives: each feed returns (reasoning, content) that can go out now."""

    fmt: ReasoningFormat
    state: State
    _buf: str = field(default="")

    def feed(self, new: str) -> tuple[str, str]:
        self._buf += new
        reasoning, content = "", ""
        while self._buf:
            if self.state == "before":
                head = self._buf.lstrip()
                if head.startswith(self.fmt.start):
                    self._buf, self.state = head[len(self.fmt.start) :], "thinking"
                    continue
                if self.fmt.start.startswith(head):  # empty or a start of the tag: wait for more
                    break
                self.state = "answer"
            if self.state == "thinking":
                i = self._buf.find(self.fmt.end)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf, self.state = self._buf[i + len(self.fmt.end) :], "answer"
                    continue
                keep = _held(self._buf, self.fmt.end)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content += self._buf
            self._buf = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply ended: an unclosed thought's tail is reasoning, the rest content."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self.state == "thinking" else ("", rest)


def split_reasoning(fmt: ReasoningFormat, state: State, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply, each None when empty; the same split a stream gives."""
    stream = ReasoningStream(fmt, state)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, (c1 + c2) or None


@dataclass(slots=True)
class ReplySplit:
    """The replies of one request to a thinking model split into (reasoning, content), as every front reports
    them: whole replies (`whole`), or a stream's deltas, one `ReasoningStream` per sample (`delta`)."""

    thought: Thought
    _streams: dict[int, ReasoningStream] = field(default_factory=dict)

    def whole(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply ("" when empty)."""
        reasoning, content = split_reasoning(self.thought.fmt, self.thought.state, text)
        return reasoning or "", content or ""

    def delta(self, sample: int, new: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) that sample `sample`'s new text lets out; with `finished`, what was held too."""
        stream = self._streams.get(sample)
        if stream is None:
            stream = self._streams[sample] = ReasoningStream(self.thought.fmt, self.thought.state)
        reasoning, content = stream.feed(new)
        if finished:
            more, rest = stream.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

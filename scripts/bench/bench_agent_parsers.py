"""The reasoning and tool-call parsers' cost on serving throughput: the same streamed workload through the OpenAI
HTTP front with both parsers on and with both off, side by side in one process (goal: on >= 0.95x off).

1. front: two engines of the tiny model (the byte tokenizer), each with its engine loop and HTTP front. Their chat
   template thinks (`<think>` opened in the generation prompt: every reply starts as reasoning) and names Hermes
   tool calls, and it renders no tools, so both configurations send the same prompt tokens. "on": the template's
   parsers (`--reasoning-parser auto`, `--tool-call-parser auto`) and `tools` with `tool_choice: auto` in every
   request, so each delta goes through the reasoning split and the tool-call stream; "off": `none` for both and
   no tools. `--concurrency` streamed chat requests at a time, `--requests` in all, each exactly `--max-tokens`
   tokens (ignore_eos, seeded sampling), read by the official async `openai` client (in the same process: its cost
   falls on both alike); generated tokens/s from the usage chunks over the wall time. Configurations alternate
   over `--rounds` rounds; the best and the median round of each are reported.
2. stream: the tool-call stream alone (`ToolStream`) per family, a reply of two calls whose arguments hold a
   `--arg-chars`-character string, fed 4 characters at a time (a few tokens per delta): microseconds per delta.

    python scripts/bench/bench_agent_parsers.py [--requests 64] [--concurrency 16] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import openai  # noqa: E402

from paged_jax.config.engine import EngineConfig  # noqa: E402
from paged_jax.engine.llm_engine import LLMEngine  # noqa: E402
from paged_jax.engine.load import load_model  # noqa: E402
from paged_jax.tokenization.chat_template import template_from_text  # noqa: E402
from paged_jax.tokenization.tool_calls import FORMATS  # noqa: E402
from serve.config import ServingConfig  # noqa: E402
from serve.engine_loop import EngineLoop  # noqa: E402
from serve.openai_api.responses import ToolStream  # noqa: E402
from serve.openai_api.server import HttpServerThread  # noqa: E402

TEMPLATE = (  # thinks (Qwen3.5's generation prompt), names Hermes calls, renders no tools (the same prompt either way)
    "{# tools: <tool_call> JSON </tool_call> #}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


async def one(client: openai.AsyncOpenAI, i: int, args, tools: bool) -> int:
    """One streamed chat request; its generated tokens (the usage chunk)."""
    extra = {"tools": TOOLS, "tool_choice": "auto"} if tools else {}
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": f"Request {i}: what is the weather?"}],
        max_tokens=args.max_tokens,
        temperature=1.0,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        **extra,
    )
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    assert tokens == args.max_tokens, tokens
    return tokens


async def workload(base_url: str, args, tools: bool) -> float:
    """Generated tokens/s of `args.requests` streamed requests, `args.concurrency` at a time."""
    sem = asyncio.Semaphore(args.concurrency)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:

        async def bounded(i: int) -> int:
            async with sem:
                return await one(client, i, args, tools)

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(bounded(i) for i in range(args.requests))))
        return tokens / (time.perf_counter() - t0)


def bench_front(args) -> None:
    config, params, tokenizer = load_model("tiny", dtype="float32")
    tokenizer.chat_template = template_from_text(TEMPLATE, "bench template")
    servers = {}
    for name, parser in (("parsers on", "auto"), ("parsers off", "none")):
        ec = EngineConfig(
            num_pages=2048,
            max_model_len=1024,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=512,
            attention_backend="auto",
            enable_prefix_caching=False,
            warmup=False,  # the warm-up round below compiles what the workload runs
            reasoning_parser=parser,
            tool_call_parser=parser,
        )
        loop = EngineLoop(LLMEngine(config, params, tokenizer, ec)).start()
        http = HttpServerThread(loop, ServingConfig(port=0, http_port=0)).start()
        servers[name] = (loop, http, parser == "auto")
    try:
        for _, http, tools in servers.values():  # a warm-up round each (compiles)
            asyncio.run(workload(http.base_url, argparse.Namespace(**{**vars(args), "requests": 8}), tools))
        rates: dict[str, list[float]] = {n: [] for n in servers}
        for _ in range(args.rounds):
            for name, (_, http, tools) in servers.items():
                rates[name].append(asyncio.run(workload(http.base_url, args, tools)))
    finally:
        for loop, http, _ in servers.values():
            http.stop()
            loop.stop()
    on, off = max(rates["parsers on"]), max(rates["parsers off"])
    mid_on, mid_off = statistics.median(rates["parsers on"]), statistics.median(rates["parsers off"])
    print(
        f"1. front: tiny model f32, {args.requests} streamed chat requests x {args.max_tokens} tokens, "
        f"{args.concurrency} at a time, best of {args.rounds} rounds (all rounds in tok/s)"
    )
    for name, rs in rates.items():
        print(f"   {name:12s} {max(rs):8.0f} gen tok/s   rounds: {', '.join(f'{r:.0f}' for r in rs)}")
    print(f"   on / off     {on / off:8.3f}x best, {mid_on / mid_off:.3f}x median   (goal >= 0.95x)")


def family_reply(family: str, chars: int) -> str:
    """A reply of two calls in `family`'s format whose arguments hold a `chars`-character string."""
    args = [json.dumps({"city": "x" * chars, "days": 3}), json.dumps({"city": "Oslo", "days": 1})]
    if family == "hermes":
        return "".join(f'<tool_call>\n{{"name": "f", "arguments": {a}}}\n</tool_call>' for a in args)
    if family == "llama3":
        return "; ".join(f'{{"name": "f", "parameters": {a}}}' for a in args)
    if family == "mistral":
        return "[TOOL_CALLS][" + ", ".join(f'{{"name": "f", "arguments": {a}}}' for a in args) + "]"
    if family == "deepseek_v3":
        calls = "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{a}\n```<｜tool▁call▁end｜>" for a in args
        )
        return f"<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
    assert family == "qwen3_coder"
    return "".join(
        "<tool_call>\n<function=f>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in json.loads(a).items())
        + "</function>\n</tool_call>"
        for a in args
    )


def bench_stream(args) -> None:
    print(
        f"2. stream: ToolStream alone, two calls (one with a {args.arg_chars}-character string), 4 characters a delta"
    )
    for family, fmt in FORMATS.items():
        text = family_reply(family, args.arg_chars)
        best = float("inf")
        for _ in range(3):
            stream, t0 = ToolStream(fmt), time.perf_counter()
            for i in range(0, len(text), 4):
                stream.feed(text[i : i + 4])
            stream.finish()
            best = min(best, time.perf_counter() - t0)
        deltas = -(-len(text) // 4)
        assert len(stream.emitted) == 2, family
        print(f"   {family:12s} {best / deltas * 1e6:7.1f} us/delta   ({deltas} deltas, {best * 1e3:.1f} ms per reply)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arg-chars", type=int, default=1000)
    p.add_argument("--sections", default="front,stream")
    args = p.parse_args()
    if "stream" in args.sections:
        bench_stream(args)
    if "front" in args.sections:
        bench_front(args)


if __name__ == "__main__":
    main()

"""Which step shapes can a batch job reach? Read from its input before the first step.

The batch job knows every request before it starts: the prompt lengths bound the largest step, and the
sampling parameters say which sampler variants its steps combine. Prompts are tokenized only until the token
budget is reached (after that, lengths no longer change the plan); lines that fail to parse are left to the
job itself, which reports them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from paged_jax.engine.input_processor import ChatPrompt, chat_prompt_ids
from paged_jax.offline.lines import parse_line
from paged_jax.offline.output_files import written_ids
from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.warmup import WarmupPlan, plan_for_requests


def _requests(engine, input_path: Path, skip: set[str], shard: tuple[int, int]) -> Iterator[tuple[int, SamplingParams]]:
    ec = engine.engine_config
    total, index, count = 0, *shard
    with open(input_path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if (lineno - 1) % count != index or not line.strip():
                continue
            try:
                item = parse_line(line, lineno, ec.sampling_defaults)
                if item.key in skip:
                    continue
                if total >= ec.max_num_batched_tokens:
                    n = 1  # the plan is at the budget already: the length no longer matters
                elif isinstance(item.prompt, ChatPrompt):
                    n = len(chat_prompt_ids(engine.tokenizer, item.prompt))
                elif isinstance(item.prompt, str):
                    n = len(engine.tokenizer.encode(item.prompt))
                else:
                    n = len(item.prompt)
            except Exception:  # noqa: BLE001 - the job reports bad lines itself
                continue
            total += item.params.n * (n + item.params.max_tokens)
            yield n, item.params


def plan_for_input(engine, input_path: Path, output_path: Path, shard: tuple[int, int] = (0, 1)) -> WarmupPlan:
    """The warm-up plan of `paged-jax generate` over `input_path` (lines already in `output_path` skipped)."""
    ec = engine.engine_config
    skip = written_ids(output_path)  # read only: this run does not hold the output's lock yet
    return plan_for_requests(
        _requests(engine, input_path, skip, shard), ec.max_num_batched_tokens, lookahead=ec.async_scheduling
    )

"""What the engine hands back: per-request outputs, one completion per sample, and timing metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the requested number of most likely (id, logprob) alternatives


@dataclass(slots=True)
class CompletionOutput:
    """One sample. `new_*` hold what this step added. `token_ids`, `text` and `logprobs` hold the whole output
    on the request's final output only (empty before): building them every step would cost each step in
    proportion to the output so far; a streaming caller accumulates the deltas instead."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # eos, stop, stop_string, length, abort, error (None while running)
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None  # when the request asked for logprobs (final output only)
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    # `LLM.chat` on a thinking model: the reply's thought, `text` then holding the answer alone (None: no thought)
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Seconds on the monotonic clock; derived figures are None until they exist."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """`prompt_logprobs` (requests with `SamplingParams.prompt_logprobs`, as vLLM's): one entry per prompt token,
    None for the first, each the token's logprob given the tokens before it and its top alternatives; set on the
    request's first output once its prompt is computed and on its final output, None on the others.
    `embedding`: an embedding request's vector (float32 values; `paged_jax.pooling_params`), on its final output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None

"""What is a sequence? One stream of tokens the scheduler runs: a request's prompt plus one sample.

A request with `n > 1` becomes n sequences; sample 0 (the leader) computes the prompt and the others
are forked from it (sharing its pages copy-on-write) on the step its prompt completes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_jax.pooling_params import PoolingParams
from paged_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_jax.lora.peft import LoraAdapter

PLACEHOLDER = -1  # the host's stand-in for a token id still on the device (the one-step lookahead)


@dataclass(frozen=True, slots=True)
class PendingToken:
    """A sequence's last output token, sampled by the in-flight step and not yet on the host
    (`paged_jax.engine.lookahead`)."""

    row: int  # its row in the in-flight step's samples
    is_last: bool  # it ends the sequence by length (max_tokens or max_model_len): nothing more to schedule


class Status(enum.Enum):
    WAITING = "waiting"  # not holding pages: new, or preempted and to be recomputed
    RUNNING = "running"  # holding pages
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop token id from the request
    STOP_STRING = "stop_string"
    LENGTH = "length"  # max_tokens or the model's length
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class TokenSequence:
    """Token state of one sample (named so as not to shadow `collections.abc.Sequence`). How many of its
    tokens have KV in the cache is the KV manager's count (`KVCacheManager.num_computed_tokens`), not a field
    here."""

    seq_id: str  # unique inside the engine: f"{request_id}#{index}"
    request_id: str
    index: int  # sample index within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed (random when the user gave none); sample i uses seed + i
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache at (first) admission
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_sent_tokens: int = 0  # output tokens already reported in a RequestOutput delta
    # One-step lookahead (`paged_jax.engine.lookahead`): set while the last output token is a placeholder whose id is
    # still on the device.
    pending: PendingToken | None = None
    forked_children: list[TokenSequence] = field(default_factory=list)  # children waiting for this leader's prompt
    lora: LoraAdapter | None = None  # the request's adapter (paged_jax.lora), None for the base model
    lora_slot: int = 0  # its device slot while running (paged_jax.lora.registry.SlotTable); 0: no adapter
    # `prompt_logprobs` requests: the prompt positions [0, this) whose next-token logprob a launched step computes
    # (the leader's; the request's prompt logprobs are its own, not each sample's)
    prompt_logprobs_done: int = 0
    # Embedding requests (`paged_jax.pooling_params`): how the prompt's final hidden states are pooled, and the
    # prompt positions [0, this) a launched step has pooled (each position once, across chunks and preemptions)
    pooling: PoolingParams | None = None
    pool_done: int = 0
    # Speculative decoding (`paged_jax.spec_decode`): tokens proposed to follow the last one, scored by the next step if
    # the scheduler finds room (it takes them: a draft is for one step).
    draft_token_ids: list[int] = field(default_factory=list)

    # prompt then output ids, kept in step with `output_token_ids` so the scheduler's per-step calls copy nothing
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)

    def set_last_token(self, token: int) -> None:
        """Replace the last output token (the lookahead's placeholder) with the sampled one."""
        self.output_token_ids[-1] = token
        self.all_token_ids[-1] = token

    def drop_last_token(self) -> None:
        """Remove the last output token (a prompt-only request's sample, which it does not keep)."""
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Some of the request's prompt logprobs are still to be computed by this sequence (the leader)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and self.prompt_logprobs_done < len(self.prompt_token_ids) - 1
        )

    @property
    def needs_all_positions(self) -> bool:
        """Every prompt position's hidden state is still wanted (prompt logprobs, mean pooling), so the prefix
        cache (whose positions have no hidden states) is not read."""
        mean = self.pooling is not None and self.pooling.pooling == "mean"  # never: another request's longer
        return self.needs_prompt_logprobs or mean  # cached prefix would skip positions not yet pooled

    def pool_positions(self, end: int) -> range:
        """The prompt positions a step computing up to `end` pools (marked done): mean pooling every new one,
        last-token pooling only the last."""
        assert self.pooling is not None
        n = len(self.prompt_token_ids)
        first = self.pool_done if self.pooling.pooling == "mean" else n - 1
        stop = min(end, n)
        if stop <= max(first, self.pool_done):
            return range(0)
        self.pool_done = stop
        return range(first, stop)

    @property
    def prefix_keys(self) -> tuple[str, ...]:
        """The prefix cache's extra keys for this sequence's blocks (`paged_jax.kv_cache.hashing`): its cache salt
        and its adapter's digest, so neither another tenant nor another adapter is ever served its KV."""
        keys = () if self.cache_salt is None else ("salt:" + self.cache_salt,)
        return keys if self.lora is None else (*keys, "lora:" + self.lora.digest)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

"""What happens to a request off the device: its sequences, each sampled token's stop checks, incremental
detokenization and logprobs, and the `RequestOutput`s handed back. Requests arrive checked
(`paged_jax.engine.input_processor`).

The engine (`paged_jax.engine.llm_engine`) runs the step loop: it appends each sampled token to its sequence and asks
`OutputProcessor.check_token` whether that token ends the sequence; it then frees the pages of a sequence
that finished (the scheduler's `remove`). Nothing here touches the device, the scheduler or the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from paged_jax.engine.input_processor import ProcessedRequest
from paged_jax.errors import FieldError
from paged_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from paged_jax.sampling_params import SamplingParams
from paged_jax.sched.sequence import FinishReason, TokenSequence
from paged_jax.structured.backend import Matcher
from paged_jax.tokenization.detokenizer import Detokenizer
from paged_jax.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from paged_jax.worker.prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class RequestState:
    """One request in flight: its prompt, its `n` sequences and their detokenizers (one per sample)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[TokenSequence]
    detoks: list[Detokenizer]
    arrival_time: float
    matchers: list[Matcher] | None = None  # structured output: one grammar matcher per sample
    # `prompt_logprobs` requests: entry i for prompt token i (None first), filled as the prompt's steps complete
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = field(default=False)  # already on an output (then again only on the final one)
    # embedding requests: the sum of the pooled final hidden states [H] f32 so far, and the finished embedding
    pooled_sum: np.ndarray | None = None
    embedding: np.ndarray | None = None

    def add_pooled(self, row: np.ndarray) -> None:
        """Add one step's pooled sum [H] (`paged_jax.worker.pooling`)."""
        self.pooled_sum = row.copy() if self.pooled_sum is None else self.pooled_sum + row

    def matcher(self, seq: TokenSequence) -> Matcher | None:
        return None if self.matchers is None else self.matchers[seq.index]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    """The requests an engine holds, keyed by request id, and everything about them that is not scheduling.

    `eos_token_ids` end generation (unless `ignore_eos`); `max_model_len` bounds prompt + output; `seed`
    seeds the requests that do not set their own (so a run is reproducible)."""

    def __init__(self, tokenizer: Tokenizer, *, eos_token_ids: Sequence[int], max_model_len: int, seed: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}
        self._rng = np.random.default_rng(seed)

    # -- the request table (owned here; the engine asks, never reaches in) -------------------------------
    def get(self, request_id: str) -> RequestState | None:
        return self.requests.get(request_id)

    def pop(self, request_id: str) -> RequestState | None:
        """Forget a request (finished, aborted or refused after registration); None if it is unknown."""
        return self.requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    # -- new requests ---------------------------------------------------------------------------------
    def check_request_id(self, request_id: str) -> None:
        """FieldError for a request id that is not a non-empty string or is in use."""
        if not isinstance(request_id, str) or not request_id:
            raise FieldError("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise FieldError("request_id", f"{request_id!r} is already in use")

    def add_request(self, request_id: str, request: ProcessedRequest, arrival_time: float | None) -> RequestState:
        """Register a request the input processor accepted (and the engine found room for); returns it with its
        sequences (not yet scheduled). Raises FieldError for a bad or used request id."""
        self.check_request_id(request_id)
        params, ids = request.params, request.prompt_token_ids
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [
            TokenSequence(
                f"{request_id}#{i}",
                request_id,
                i,
                list(ids),
                params,
                seed,
                request.cache_salt,
                arrival_time=now,
                pooling=request.pooling,
            )
            for i in range(params.n)
        ]
        detoks = [
            Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.spaces_between_special_tokens)
            for _ in seqs
        ]
        req = RequestState(request_id, request.prompt, list(ids), params, seqs, detoks, now)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[request_id] = req
        return req

    # -- each sampled token ---------------------------------------------------------------------------
    def check_token(
        self, req: RequestState, seq: TokenSequence, token: int, logprobs: tuple[float, list[tuple[int, float]]] | None
    ) -> FinishReason | None:
        """Record `token`, already appended to `seq`: its `logprobs` (its own and the requested top (id, logprob)
        pairs, when the request asked), the first-token time, its text; return why it ends the sequence (EOS, a
        stop id, a stop string, the length), or None. Sets `stop_reason` and `finish_time` when it ends; freeing
        the pages is the caller's."""
        p = seq.params
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        n_out = len(seq.output_token_ids)
        reason: FinishReason | None = None
        stop_reason: str | int | None = None  # the stop token id or stop string
        if not p.ignore_eos and token in self.eos_token_ids and n_out >= p.min_tokens:
            reason = FinishReason.EOS
        elif token in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = FinishReason.STOP, token
        else:
            detok = req.detoks[seq.index]
            if p.detokenize:
                detok.add([token], check_stop=n_out >= p.min_tokens)
            if detok.stopped_on is not None:
                reason, stop_reason = FinishReason.STOP_STRING, detok.stopped_on
            elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            seq.stop_reason = stop_reason
            seq.finish_time = now
        return reason

    def add_prompt_logprobs(self, req: RequestState, positions: range, values: PromptLogprobs, first_row: int) -> None:
        """Record rows [first_row, first_row + len(positions)) of a step's prompt logprobs: position p's row is
        the logprob of prompt token p + 1 (positions come in order, each once)."""
        assert req.prompt_logprobs is not None and len(req.prompt_logprobs) == positions.start + 1, positions
        k = req.params.prompt_logprobs
        assert k is not None, "prompt logprobs recorded for a request that asked for them"
        ids = req.prompt_token_ids
        req.prompt_logprobs.extend(values.entry(first_row + i, ids[p + 1], k) for i, p in enumerate(positions))

    def finish_prompt_only(self, req: RequestState, seq: TokenSequence) -> FinishReason:
        """A `max_tokens=0` sequence whose prompt is computed: it ends by length, with no tokens (an embedding
        request with its embedding made from the pooled sum)."""
        seq.finish_time = time.monotonic()
        if seq.pooling is not None:
            assert req.pooled_sum is not None, "an embedding request's last prompt position was pooled"
            req.embedding = seq.pooling.finish(req.pooled_sum, len(req.prompt_token_ids))
        return FinishReason.LENGTH

    def is_last_token(self, seq: TokenSequence) -> bool:
        """Whether the token `seq` just got is its last for length alone (max_tokens or max_model_len)."""
        return len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    # -- outputs --------------------------------------------------------------------------------------
    def output(self, req: RequestState, final: bool) -> RequestOutput:
        """This step's output of `req`: what each sample added since the last output (the cost of a step is
        that of its new tokens, not of the whole output), plus the whole output when `final`."""
        completions = []
        for seq, detok in zip(req.seqs, req.detoks, strict=True):
            sent, seq.num_sent_tokens = seq.num_sent_tokens, len(seq.output_token_ids)
            new_ids = seq.output_token_ids[sent:]
            new_logprobs = None
            if seq.params.logprobs is not None:
                new_logprobs = [
                    TokenLogprob(t, lp, top) for t, (lp, top) in zip(new_ids, seq.output_logprobs[sent:], strict=True)
                ]
            new_text = detok.take_delta(final=seq.finished)  # first: a finished sample's pending text is flushed
            c = CompletionOutput(
                index=seq.index,
                token_ids=[],
                text="",
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                new_token_ids=new_ids,
                new_text=new_text,
                new_logprobs=new_logprobs,
            )
            if final:
                c.token_ids, c.text = list(seq.output_token_ids), detok.text
                if seq.params.logprobs is not None:
                    c.logprobs = [
                        TokenLogprob(t, lp, top)
                        for t, (lp, top) in zip(seq.output_token_ids, seq.output_logprobs, strict=True)
                    ]
            completions.append(c)
        lead = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finish_time=max((s.finish_time for s in req.seqs if s.finish_time), default=None) if final else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_cached_prompt_tokens=lead.num_cached_prompt,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, final, metrics)
        if final and req.embedding is not None:
            out.embedding = req.embedding.tolist()
        complete = req.prompt_logprobs is not None and len(req.prompt_logprobs) == len(req.prompt_token_ids)
        if complete and (final or not req.prompt_logprobs_sent):
            out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return out

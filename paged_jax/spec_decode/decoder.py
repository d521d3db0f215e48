"""The engine's side of speculative decoding: who speculates, their drafts before each step, the KV and the
metrics after it.

Each step (all tokens on the host): `propose` asks the proposer for drafts for every running, decoding sequence
that is speculating, at most k and never past its `max_tokens` or the model length, and leaves them on the
sequence for the scheduler. After the step, `settle` counts what each verified sequence kept (the engine has
appended the kept tokens) and rolls its KV back to them (`KVCacheManager.accept_drafts`); a linear-attention
hybrid's recurrent state, which cannot be cut back, is restored from a checkpoint taken before the verify and its
next step re-runs the kept tokens (`paged_jax.kv_cache.state_pool`).

With `adaptive_k` each sequence drafts `draft_len` tokens at most (k at first): after a verify that kept all its
drafts it doubles (up to k), after one that rejected some it is the drafts kept + 1 (a copy that resumes after an
edit earns its length back within a few steps, a sequence that keeps diverging drafts one token at a time).

Speculation pauses where it does not pay (`SpeculativeConfig`). Per sequence: after `probe_tokens` drafts whose
acceptance rate is below `min_acceptance_rate` the sequence decodes plainly for `pause_tokens` output tokens
(doubling, up to 16x, each time it pauses so again) and then probes again; after `max_misses` steps in a row
with no draft it pauses for `pause_tokens` (not doubled).
Per batch (`pause_by_cost`): the `CostGate` compares the measured decode tokens per second with and without
speculation (`observe`, after each collected step) and turns speculation off for the batch size where it was
slower. A request with `SamplingParams.speculate=False` never speculates. While no running sequence speculates the
engine keeps its one-step lookahead; a batch with a speculating sequence runs without it (its drafts depend on the
tokens the previous step accepts, and the next step's positions on how many it accepted), see `needs_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_jax.config.speculative import SpeculativeConfig
from paged_jax.spec_decode.cost import CostGate
from paged_jax.spec_decode.proposer import DraftRequest, Proposer
from paged_jax.spec_decode.stats import SpecStats
from paged_jax.worker.spec_verify import REJECTED

if TYPE_CHECKING:
    import numpy as np

    from paged_jax.kv_cache import KVCacheManager, StateSlots
    from paged_jax.sched.output import SchedulerOutput
    from paged_jax.sched.sequence import TokenSequence

MAX_PAUSE_FACTOR = 16
REFRESH_FACTOR = 16  # the gate re-measures plain decoding after this many pause lengths of speculating


@dataclass(slots=True)
class SeqSpec:
    """One sequence's speculation record."""

    proposed: int = 0  # drafts scored since the last pause
    accepted: int = 0
    misses: int = 0  # steps in a row without a draft
    pauses: int = 0  # low-acceptance pauses so far (each doubles the next)
    resume_at: int = 0  # output length from which it speculates again
    draft_len: int = 0  # the most drafts it asks for next (adaptive_k; 0: not yet set, k)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.seqs: dict[str, SeqSpec] = {}
        self.stats = SpecStats()
        self.gate = (
            CostGate(
                config.cost_probe_steps,
                config.cost_pause_steps,
                REFRESH_FACTOR * config.cost_pause_steps,
                config.cost_margin,
            )
            if config.pause_by_cost
            else None
        )

    def _state(self, seq: TokenSequence) -> SeqSpec:
        state = self.seqs.get(seq.seq_id)
        if state is None:
            state = self.seqs[seq.seq_id] = SeqSpec()
        return state

    def is_speculating(self, seq: TokenSequence) -> bool:
        """It asked for speculation and its own record does not pause it (the batch may still be off)."""
        if not seq.params.speculate:
            return False
        state = self.seqs.get(seq.seq_id)
        return state is None or len(seq.output_token_ids) >= state.resume_at

    def _room(self, seq: TokenSequence) -> int:
        """Drafts that can still be useful: the step yields drafts + 1 tokens, within max_tokens and the model."""
        left = min(seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
        return min(self.config.num_speculative_tokens, left - 1)

    def needs_sync(self, inflight: SchedulerOutput, running: list[TokenSequence], kv: KVCacheManager) -> bool:
        """Whether the engine must collect the in-flight step before scheduling the next: it verified drafts (the
        KV of its sequences is settled only then), or a decoding sequence speculates (its drafts need its tokens)."""
        if any(item.draft for item in inflight.scheduled):
            return True
        return not self._batch_off(running) and any(
            self._decoding(seq, kv) and self.is_speculating(seq) for seq in running
        )

    def _batch_off(self, running: list[TokenSequence]) -> bool:
        """No sequence speculates: more run than `disable_by_batch_size`, or the cost gate pauses this batch size."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return True
        return self.gate is not None and not self.gate.allows(len(running))

    def observe(self, sched: SchedulerOutput, synced: bool, tokens: int, seconds: float) -> None:
        """The engine collected `sched`, which yielded `tokens` in `seconds` of wall time; `synced`: the engine
        ran it without the lookahead for speculation. Decode-only steps feed the cost gate."""
        if self.gate is None or not sched.scheduled or any(item.num_new != 1 for item in sched.scheduled):
            return
        speculating = synced or any(item.draft for item in sched.scheduled)
        self.gate.observe(len(sched.scheduled), speculating, tokens, seconds)

    @staticmethod
    def _decoding(seq: TokenSequence, kv: KVCacheManager) -> bool:
        """Its prompt is computed: the next step computes its last token (and samples)."""
        return seq.seq_id in kv and kv.num_computed_tokens(seq.seq_id) >= seq.num_tokens - 1

    def propose(self, running: list[TokenSequence], kv: KVCacheManager) -> None:
        """Set `draft_token_ids` of every running sequence (empty where it does not speculate this step)."""
        requests = []
        for seq in running:
            seq.draft_token_ids = []
        if self._batch_off(running):
            return
        for seq in running:
            if seq.pending is not None or seq.forked_children or not self._decoding(seq, kv):
                continue  # its last token is on the device, it forks its other samples in this step, or it prefills
            room = self._room(seq)
            if self.config.adaptive_k:
                state = self.seqs.get(seq.seq_id)
                if state is not None and state.draft_len:
                    room = min(room, state.draft_len)
            if room >= 1 and self.is_speculating(seq):
                requests.append(DraftRequest(seq, room))
        if not requests:
            return
        for request, draft in zip(requests, self.proposer.propose(requests), strict=True):
            seq = request.seq
            if draft:
                seq.draft_token_ids = list(draft)
                continue
            state = self._state(seq)
            state.misses += 1
            if state.misses >= self.config.max_misses:
                self._pause(seq, state, doubling=False)

    def settle(
        self, sched: SchedulerOutput, tokens: np.ndarray, kv: KVCacheManager, state_slots: StateSlots | None = None
    ) -> None:
        """After the engine appended the kept tokens of `sched` (`tokens` [R]: REJECTED where not kept): count each
        verified sequence's kept drafts and roll its KV back to them. A linear-attention hybrid (`state_slots`)
        that rejected a draft also rolls its state back to before the verify, to re-run the verify's tokens and
        the kept drafts in its next step (`paged_jax.kv_cache.state_pool`)."""
        first_row: dict[int, int] = {}
        for r, row in enumerate(sched.sample_rows):
            if not row.draft_prefix:
                first_row.setdefault(row.index, r)
        for index, item in enumerate(sched.scheduled):
            if not item.draft:
                continue
            r0, k = first_row[index], len(item.draft)
            kept = 0
            while kept < k and tokens[r0 + kept + 1] != REJECTED:
                kept += 1
            seq = item.seq
            self.stats.record(k, kept)
            state = self._state(seq)
            state.misses = 0
            state.proposed += k
            state.accepted += kept
            state.draft_len = next_draft_len(k, kept, self.config.num_speculative_tokens)
            if not seq.finished and seq.seq_id in kv:
                kv.accept_drafts(seq.seq_id, kept, seq.all_token_ids)
                if state_slots is not None and kept < k:
                    state_slots.rollback(seq.seq_id, item.num_new + kept)
                cfg = self.config
                if state.proposed >= cfg.probe_tokens and state.accepted < cfg.min_acceptance_rate * state.proposed:
                    self._pause(seq, state)

    def _pause(self, seq: TokenSequence, state: SeqSpec, doubling: bool = True) -> None:
        factor = min(2**state.pauses, MAX_PAUSE_FACTOR) if doubling else 1
        state.pauses += doubling
        state.resume_at = len(seq.output_token_ids) + self.config.pause_tokens * factor
        state.proposed = state.accepted = state.misses = 0
        state.draft_len = 0  # back to k when it resumes

    def release(self, seq: TokenSequence) -> None:
        """Forget a sequence that left the engine."""
        self.seqs.pop(seq.seq_id, None)
        self.proposer.release(seq.seq_id)


def next_draft_len(drafted: int, kept: int, k: int) -> int:
    """A sequence's next draft length after a verify that kept `kept` of its `drafted` drafts (adaptive_k): twice
    as many after keeping them all (at most k), else one more than it kept."""
    return min(k, 2 * drafted) if kept == drafted else min(k, kept + 1)

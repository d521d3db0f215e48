"""The draft-model proposer: a smaller model with the target's vocabulary guesses k tokens greedily.

It owns a `ModelRunner` (its own jitted steps and buckets) over its own paged KV pool and `KVCacheManager` (same
page size as the target, its own block tables and prefix cache: the draft's KV is a different model's, so nothing
can be shared with the target's pages). A sequence's draft KV lives from its first proposal until it leaves the
engine; each proposal first catches the draft up on the tokens the sequence gained since (its prompt the first
time; later the drafts the target kept and its own next token), in chunks of the token budget, then runs k - 1
one-token steps. The drafts d_1..d_{k-1} are written as draft slots (`allocate_slots(num_draft=...)`); at the
next proposal the leading ones that equal the sequence's actual tokens are kept (`accept_drafts`) and the rest
rolled back, so the draft never recomputes a token it already has right.

Drafts are the draft model's argmax (point masses): the verify step's rule keeps the target's distribution for
sampled requests too (`paged_jax.spec_decode`).

With `EngineConfig.background_compiles` a proposal runs only in compiled draft steps (`draft_gate`): a sequence
gets no drafts while the draft step it would need compiles off the engine thread.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from paged_jax.config import LINEAR_ATTENTION_TYPES
from paged_jax.kv_cache import KVCacheManager
from paged_jax.model.loader.weights import load_weights
from paged_jax.sched.output import SampleRow, ScheduledSeq, SchedulerOutput
from paged_jax.spec_decode.draft_gate import DraftGate
from paged_jax.spec_decode.proposer import DraftRequest
from paged_jax.worker.runner import ModelRunner
from paged_jax.worker.step_functions import GREEDY
from paged_jax.worker.warmup import WarmupPlan, run_warmup

if TYPE_CHECKING:
    from paged_jax.config import ModelConfig
    from paged_jax.config.engine import EngineConfig
    from paged_jax.config.speculative import SpeculativeConfig
    from paged_jax.sched.sequence import TokenSequence

log = logging.getLogger(__name__)


def check_draft(draft: ModelConfig, target: ModelConfig, max_model_len: int) -> None:
    """The draft must read and write the target's token ids and reach the engine's length, and keep no recurrent
    state (its proposer has no state slots)."""
    if draft.model_type in LINEAR_ATTENTION_TYPES:
        raise ValueError(f"speculative_config.model: a {draft.model_type!r} draft keeps a recurrent state, unsupported")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size} (a draft must share the target's vocabulary)"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft reaches {draft.max_position_embeddings} positions, the engine's "
            f"max_model_len is {max_model_len}"
        )


class DraftModelProposer:
    def __init__(
        self, config: ModelConfig, params, *, k: int, num_pages: int, ec: EngineConfig, max_model_len: int
    ) -> None:
        self.k = k
        self.kv = KVCacheManager(num_pages, ec.page_size, ec.enable_prefix_caching)
        self.budget = ec.max_num_batched_tokens
        self.runner = ModelRunner(
            config,
            params,
            num_pages=num_pages,
            page_size=ec.page_size,
            max_model_len=max_model_len,
            max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            attention_backend=ec.attention_backend,
            scan_layers=ec.scan_layers,
            executable_store=ec.executable_store,
        )
        self.drafts: dict[str, list[int]] = {}  # seq id -> the drafts its draft slots hold
        self.compile_gate = DraftGate(self.runner) if ec.background_compiles else None
        if ec.warmup:  # its forward steps and the greedy sampler: no lookahead, copies or prompt logprobs
            plan = WarmupPlan(sampler_flags=(GREEDY,), lookahead=False, copies=False)
            run_warmup(self.runner, replace(plan, prompt_logprobs=False), what="draft")

    @classmethod
    def load(
        cls, spec: SpeculativeConfig, target: ModelConfig, ec: EngineConfig, max_model_len: int, num_pages: int
    ) -> DraftModelProposer:
        assert spec.model is not None, "validated: method draft_model names its model"
        loaded = load_weights(spec.model, quantization=spec.quantization)
        config, params = loaded.config, loaded.params
        check_draft(config, target, max_model_len)
        pages = spec.draft_num_pages or num_pages
        return cls(config, params, k=spec.num_speculative_tokens, num_pages=pages, ec=ec, max_model_len=max_model_len)

    # -- proposing --------------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, TokenSequence, int]] = []  # (request index, sequence, drafts wanted)
        catch_up: list[tuple[TokenSequence, int, int]] = []  # (sequence, first position, tokens) to compute
        budget = self.budget
        if self.compile_gate is not None:  # only compiled draft steps: at most `cap` tokens and sequences a step
            cap = self.compile_gate.cap()
            if cap is None:
                return out
            if len(requests) > cap or any(r.seq.num_tokens - self._computed(r.seq) > cap for r in requests):
                self.compile_gate.grow(cap)
            requests, budget = requests[:cap], min(budget, cap)
        for i, request in enumerate(requests):
            seq, want = request.seq, min(self.k, request.max_drafts)
            start = self._prepare(seq, want)
            if start is None:
                continue  # no room in the draft's pool: no drafts this step
            live.append((i, seq, want))
            catch_up.append((seq, start, seq.num_tokens - start))
        if not live:
            return out
        last = self._catch_up(catch_up, budget)  # each sequence's first draft
        drafts = {seq.seq_id: [int(last[seq.seq_id])] for _, seq, _ in live}
        for j in range(1, max(want for _, _, want in live)):
            active = [seq for _, seq, want in live if want > j]
            sched = SchedulerOutput()
            for seq in active:
                prev = drafts[seq.seq_id][-1]
                item = ScheduledSeq(seq, seq.num_tokens + j - 1, 0, [prev])
                sched.scheduled.append(item)
                sched.sample_rows.append(SampleRow(seq, len(sched.scheduled) - 1, (prev,)))
            sched.num_tokens = len(active)
            sched.block_tables = self.kv.step_tables([seq.seq_id for seq in active])
            ids = np.asarray(jax.device_get(self.runner.launch_greedy(sched)))
            for r, seq in enumerate(active):
                drafts[seq.seq_id].append(int(ids[r]))
        for i, seq, want in live:
            out[i] = drafts[seq.seq_id][:want]
            self.drafts[seq.seq_id] = out[i][:-1]  # the ones written to draft slots
        return out

    def _prepare(self, seq: TokenSequence, want: int) -> int | None:
        """Settle `seq`'s draft slots against its tokens now, then allocate its catch-up tokens and `want` - 1
        draft slots. Returns the first position to compute, or None when the pool has no room."""
        tokens = seq.all_token_ids
        key = seq.seq_id
        if key in self.kv:
            computed = self.kv.num_computed_tokens(key)
            held = self.drafts.pop(key, [])[: self.kv.num_draft_slots(key)]
            kept = 0
            while kept < len(held) and computed + kept < len(tokens) - 1 and tokens[computed + kept] == held[kept]:
                kept += 1  # never the last token: it is computed with the catch-up, which samples the first draft
            self.kv.accept_drafts(key, kept, tokens)
            start = self.kv.num_computed_tokens(key)
            if self.kv.allocate_slots(key, tokens, len(tokens) - start, num_draft=want - 1) is None:
                return None
            return start
        if not self.kv.can_ever_fit(len(tokens) + want):
            return None
        cached = self.kv.admit(key, tokens, len(tokens))
        if cached is None:
            return None
        if self.kv.allocate_slots(key, tokens, 0, num_draft=want - 1) is None:
            self.kv.free(key)
            return None
        return cached

    def _computed(self, seq: TokenSequence) -> int:
        """Tokens of `seq` the draft has computed (0 before its first proposal)."""
        return self.kv.num_computed_tokens(seq.seq_id) if seq.seq_id in self.kv else 0

    def _catch_up(self, work: list[tuple[TokenSequence, int, int]], step_budget: int) -> dict[str, int]:
        """Compute each sequence's tokens [start, start + n) in steps of at most `step_budget` tokens; returns
        each sequence's argmax after its last token (its first draft)."""
        firsts: dict[str, int] = {}
        queue: list[list[Any]] = [list(w) for w in work]  # [seq, start, n], advanced in place
        while queue:
            sched, budget, rows = SchedulerOutput(), step_budget, []
            while queue and budget > 0 and len(sched.scheduled) < self.runner.max_num_seqs:
                seq, start, n = queue[0]
                chunk = min(n, budget)
                sched.scheduled.append(ScheduledSeq(seq, start, chunk))
                budget -= chunk
                if chunk == n:
                    queue.pop(0)
                    sched.sample_rows.append(SampleRow(seq, len(sched.scheduled) - 1))
                    rows.append(seq.seq_id)
                else:
                    queue[0] = [seq, start + chunk, n - chunk]
            sched.num_tokens = step_budget - budget
            sched.block_tables = self.kv.step_tables([item.seq.seq_id for item in sched.scheduled])
            ids = np.asarray(jax.device_get(self.runner.launch_greedy(sched)))
            firsts.update({key: int(ids[r]) for r, key in enumerate(rows)})
        return firsts

    def release(self, seq_id: str) -> None:
        self.drafts.pop(seq_id, None)
        if seq_id in self.kv:
            self.kv.free(seq_id)

    def stop_compiles(self, timeout: float | None = None) -> None:
        """Start no more draft compiles and wait up to `timeout` for the running one (shut-down)."""
        if self.compile_gate is not None:
            self.compile_gate.close(timeout)

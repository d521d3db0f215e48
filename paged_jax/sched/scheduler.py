"""Who gets to run this step? Continuous batching with one token budget per step.

Running sequences go first (decodes and unfinished prompt chunks), in admission order; when one
cannot get its pages (those of every KV cache group, allocated at once), the most recently admitted running
sequence is preempted: its pages freed, its full blocks left in the prefix cache, and later recomputed; or, with a
host tier, swapped out to host memory and later copied back (`paged_jax.kv_cache.swap`: whichever its cost model
says is cheaper). Waiting sequences are then admitted round-robin between client requests (`paged_jax.sched.waiting`:
arrival order unless a request brought several prompts) while the token budget, the sequence limit and the pages
last; their cached prefix blocks are skipped.
Host -> device copies (prefix blocks only the host tier holds, and swapped requests' pages) count against a budget
of their own, in pages (`max_restore_pages`): a copy's cost is its bytes, not compute, so it is not charged to the
token budget, but a burst of them must not stall the step's decodes; a request whose copies would exceed what is
left waits for the next step (the first one of a step always goes, however many pages it copies).
A prompt longer than the budget (or the chunk size) is prefilled in chunks.

Speculative decoding (`paged_jax.spec_decode`): a decoding sequence may carry draft tokens (`draft_token_ids`, set by
the engine's proposer before the step); they are scheduled after its last token inside the same token budget,
with KV slots reserved for them, and dropped (never preempting anyone) when the budget or the pages run short.
Each scheduled draft adds one sample row, so the step scores 1 + k positions of that sequence.

The output (`paged_jax.sched.output`) is everything the runner needs and nothing more, the LoRA adapters to
write into device slots first included. A sequence with an adapter takes a device slot at admission and returns it
when it stops running (`paged_jax.lora.registry.SlotTable`), and so does each sequence of a linear-attention
hybrid with its recurrent-state slot (`paged_jax.kv_cache.state_pool`; a fork's is copied from its leader's;
prefill chunks end at its state snapshot points, `paged_jax.kv_cache.state_snapshots`; a sequence verifying drafts
has its slot checkpointed before the step, and after a rejection its next chunk starts with the tokens its restored
state re-runs);
while every adapter slot is busy with other adapters it waits, and the requests behind it are admitted past it.
How many
of a sequence's tokens are computed is the KV manager's to know (`num_computed_tokens`); a waiting sequence
holds no pages and has none computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from paged_jax.kv_cache import KVCacheManager, StateSlots, SwapSpace
from paged_jax.lora.registry import SlotTable
from paged_jax.sched.output import SampleRow, ScheduledSeq, SchedulerOutput
from paged_jax.sched.sequence import FinishReason, Status, TokenSequence
from paged_jax.sched.waiting import WaitingQueue


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int | None = None,
        enable_prefix_caching: bool = True,
        reserve_tokens: int | None = None,
        watermark: float = 0.01,
        lora_slots: SlotTable | None = None,
        swap: SwapSpace | None = None,
        max_restore_pages: int = 128,
        state_slots: StateSlots | None = None,
    ) -> None:
        self.kv = kv
        self.swap = swap  # swap-on-preemption (`paged_jax.kv_cache.swap`); None: a preempted request recomputes
        self.max_restore_pages = max_restore_pages  # host -> device page copies per step (module docstring)
        self.state_slots = state_slots  # recurrent-state slots of a linear-attention hybrid (None: no such layers)
        self.lora_slots = lora_slots  # device slots of LoRA adapters (None: LoRA is off)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_size = chunk_size or max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        # Benchmark baseline only: admit a sequence only if `reserve_tokens` slots per running sequence fit in
        # the pool, as a contiguous-reservation engine (one max_model_len region per request) would.
        self.reserve_tokens = reserve_tokens
        # Admission leaves this many pages free while others run (vLLM's watermark, 1% by default).
        self.watermark_pages = int(watermark * (kv.num_pages - 1))
        self.waiting = WaitingQueue()
        self.running: list[TokenSequence] = []
        self.num_preemptions = 0

    # -- membership -----------------------------------------------------------------------------
    def add(self, leader: TokenSequence, children: list[TokenSequence], group: str | None = None) -> None:
        """Queue a request: its leader waits; its other samples are forked when the prompt completes. Requests
        with the same `group` (the prompts of one client request) share one turn of the admission round-robin;
        None: the request is a group of its own."""
        leader.forked_children = children
        self.waiting.append(leader, f"group:{group}" if group is not None else f"request:{leader.request_id}")

    def remove(self, seq: TokenSequence, reason: FinishReason) -> None:
        """Finish or abort `seq`: leave every queue and return every page it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
            self._release_slot(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.swap is not None and seq.seq_id in self.swap:  # aborted while swapped out: its slots go back
            self.swap.drop(seq.seq_id)
        for child in seq.forked_children:  # samples that never forked end with their leader
            child.status, child.finish_reason = Status.FINISHED, reason
        seq.forked_children = []
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # -- one step ---------------------------------------------------------------------------------
    def schedule(
        self, budget: int | None = None, admit: Callable[[TokenSequence], bool] | None = None
    ) -> SchedulerOutput:
        """One step. `budget`: at most this many tokens (None: the token budget); `admit(seq)`: False keeps a
        waiting sequence waiting this step, with the ones behind it admitted past it (`paged_jax.engine.compile_gate`:
        its step shapes are not compiled yet)."""
        out = SchedulerOutput()
        if self.kv.snapshots is not None:
            self.kv.snapshots.commit()  # the last step's state snapshots can be hit from now on
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        scheduled: set[str] = set()
        for seq in list(self.running):  # a snapshot: children forked during this step join the list
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING or (seq.pending is not None and seq.pending.is_last):
                continue  # preempted earlier in this loop, or its pending token is its last
            computed = self.kv.num_computed_tokens(seq.seq_id)
            rerun = self._rerun(seq)
            num_new = self._to_snapshot(seq, computed, min(seq.num_tokens - computed, budget - rerun, self.chunk_size))
            if num_new <= 0:  # an embedding whose prompt a launched step completes: the engine ends it then; or a
                continue  # re-run that does not fit what is left of the budget
            cache = seq.pending is None  # a placeholder (lookahead) must not be hashed; cached once its id is known
            draft = self._drafts(seq, num_new, budget - rerun)
            if rerun:  # its state catches up first: no drafts (their checkpoint would overwrite its rollback's)
                draft = []
            copies = self.kv.allocate_slots(seq.seq_id, seq.all_token_ids, num_new, cache, len(draft))
            if copies is None and draft:  # out of pages: drafts go first, before anyone is preempted
                draft = []
                copies = self.kv.allocate_slots(seq.seq_id, seq.all_token_ids, num_new, cache)
            while copies is None:  # out of pages: preempt the most recently admitted unscheduled one
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq.seq_id, seq.all_token_ids, num_new, cache)
            if copies is None:
                continue
            out.copy_ops.extend(copies)
            self._schedule(seq, num_new, out, scheduled, draft, rerun)
            if self.state_slots is not None:
                if draft:  # a hybrid's state before the verify, restored if it rejects a draft
                    self.state_slots.checkpoint(seq.seq_id)
                if rerun:
                    self.state_slots.rerun_scheduled(seq.seq_id)
            budget -= rerun + num_new + len(draft)
        if not out.preempted:
            self._admit_waiting(out, budget, scheduled, admit)
        out.num_tokens = sum(s.num_scheduled for s in out.scheduled)
        # One gather of the persistent tables (a scheduled sequence's tables do not change later in the step: it
        # allocated once, and a victim of preemption is never one already scheduled).
        out.block_tables = self.kv.step_tables([s.seq.seq_id for s in out.scheduled])
        if self.swap is not None:  # a step that runs nothing runs no copies: its swap-outs become recomputes
            self.swap.end_step(bool(out.scheduled))
        if self.state_slots is not None:
            out.state_slots = self.state_slots.step_slots([s.seq.seq_id for s in out.scheduled])
            out.state_copies = self.state_slots.take_copies()
            out.state_restores = self.state_slots.take_checkpoints()  # speculation's rollbacks and checkpoints
            if self.kv.snapshots is not None:
                out.state_copies += self.kv.snapshots.take_saves()
                out.state_restores += self.kv.snapshots.take_restores()
        if out.scheduled:  # pages move only with a step that runs (a step without work allocated nothing)
            out.kv_transfers = self.kv.take_transfers()
        return out

    def _to_snapshot(self, seq: TokenSequence, computed: int, num_new: int) -> int:
        """`num_new` cut so that a prefill chunk ends at the next state snapshot point (a hybrid's state exists only
        at a step's end; `paged_jax.kv_cache.state_snapshots`)."""
        snapshots = self.kv.snapshots
        if snapshots is None:
            return num_new
        point = snapshots.next_point(len(seq.prompt_token_ids), computed)
        return num_new if point is None else min(num_new, point - computed)

    def _rerun(self, seq: TokenSequence) -> int:
        """Tokens before the computed ones that `seq`'s next chunk recomputes for its linear layers' state (a hybrid
        whose last verify rejected a draft, `paged_jax.kv_cache.state_pool`); 0 otherwise."""
        return 0 if self.state_slots is None else self.state_slots.rerun_tokens(seq.seq_id)

    def _save_snapshot(self, seq: TokenSequence, start: int, end: int) -> None:
        """After a chunk [start, end) that ends at a snapshot point, snapshot the sequence's state there."""
        snapshots = self.kv.snapshots
        if snapshots is None or snapshots.next_point(len(seq.prompt_token_ids), start) != end:
            return
        snapshots.save(self.kv.block_hash(seq.seq_id, end // self.kv.page_size - 1), self._state().slot_of(seq.seq_id))

    def _state(self) -> StateSlots:
        assert self.state_slots is not None, "state snapshots exist only beside state slots"
        return self.state_slots

    def _drafts(self, seq: TokenSequence, num_new: int, budget: int) -> list[int]:
        """The draft tokens `seq` runs this step (taken from it: a draft is for one step): those that fit the
        budget after its `num_new` tokens, and only when those end its known tokens (it samples this step)."""
        draft, seq.draft_token_ids = seq.draft_token_ids, []
        if not draft or seq.pending is not None or self.kv.num_computed_tokens(seq.seq_id) + num_new < seq.num_tokens:
            return []
        return draft[: max(0, budget - num_new)]

    def _admit_waiting(
        self,
        out: SchedulerOutput,
        budget: int,
        scheduled: set[str],
        admit: Callable[[TokenSequence], bool] | None = None,
    ) -> None:
        # Slots already promised: every running sequence, plus the children each running leader will fork
        # when its prompt completes (they join `running` then, without passing admission again).
        promised = len(self.running) + sum(len(s.forked_children) for s in self.running)
        blocked: list[TokenSequence] = []  # waiting for a LoRA slot or a compile: the ones behind them go first
        restored = 0  # host -> device page copies this step (`max_restore_pages`)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.lora is not None and not self._slots().can_acquire(seq.lora):
                blocked.append(self.waiting.popleft())
                continue
            wanted = promised + 1 + len(seq.forked_children)
            if wanted > self.max_num_seqs:
                break
            if admit is not None and not admit(seq):
                blocked.append(self.waiting.popleft())
                continue
            if self.reserve_tokens and wanted * self.reserve_tokens > (self.kv.num_pages - 1) * self.kv.page_size:
                break
            tokens = seq.all_token_ids
            swap = self.swap if self.swap is not None and seq.seq_id in self.swap else None
            got: int | None = 0
            if swap is not None:  # swapped out: its pages come back from the host tier
                restores = swap.pages(seq.seq_id)
                cached = swap.num_computed(seq.seq_id)
                num_new = min(len(tokens) - cached, budget, self.chunk_size)
                new_pages = restores + self.kv.pages_to_grow(cached, cached + num_new)
            else:
                # Cached tokens have no logits or hidden states: a request still owing prompt logprobs (or a mean
                # pooling) computes its whole prompt.
                read_cache = self.enable_prefix_caching and not seq.needs_all_positions
                cached, restores = self.kv.lookup_restores(tokens, seq.prefix_keys) if read_cache else (0, 0)
                num_new = self._to_snapshot(seq, cached, min(len(tokens) - cached, budget, self.chunk_size))
                new_pages = self.kv.pages_to_grow(cached, cached + num_new)  # in every KV cache group
            if restored and restored + restores > self.max_restore_pages:
                break  # its copies wait for the next step's restore budget
            if self.running and self.kv.num_free_pages() - new_pages < self.watermark_pages:
                break  # keep a few pages for the running sequences to grow into (fewer preemptions)
            if swap is not None:
                if self.kv.num_free_pages() < new_pages or not swap.swap_in(seq.seq_id, tokens):
                    break
                grown = self.kv.allocate_slots(seq.seq_id, tokens, num_new, seq.pending is None)
                assert grown == [], grown  # its pages are private and were counted free above
            else:
                got = self.kv.admit(seq.seq_id, tokens, num_new, seq.prefix_keys, read_cache=read_cache)
                if got is None:
                    break
                assert got == cached, (got, cached)
                if seq.num_preemptions == 0:
                    seq.num_cached_prompt = min(got, len(seq.prompt_token_ids))
            restored += restores
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self._take_slot(seq, out)
            if got and self.kv.snapshots is not None:  # the linear layers' state at the hit point
                key = self.kv.block_hash(seq.seq_id, got // self.kv.page_size - 1)
                self.kv.snapshots.restore(key, self._state().slot_of(seq.seq_id))
            self.running.append(seq)
            promised = wanted
            self._schedule(seq, num_new, out, scheduled)
            budget -= num_new
        self.waiting.extendleft(reversed(blocked))

    def _take_slot(self, seq: TokenSequence, out: SchedulerOutput, parent: TokenSequence | None = None) -> None:
        """Give a sequence starting to run its state slot (a fork's: a copy of `parent`'s after the step) and its
        adapter's device slot (loading the adapter there if needed)."""
        if self.state_slots is not None:
            if parent is None:
                self.state_slots.acquire(seq.seq_id)
            else:
                self.state_slots.fork(parent.seq_id, seq.seq_id)
        if seq.lora is None:
            return
        seq.lora_slot, load = self._slots().acquire(seq.lora)
        if load is not None:
            out.lora_loads.append(load)

    def _slots(self) -> SlotTable:
        """The adapter slots; a sequence with an adapter exists only when LoRA is on (the engine checks)."""
        assert self.lora_slots is not None, "a LoRA request reached a scheduler without adapter slots"
        return self.lora_slots

    def _release_slot(self, seq: TokenSequence) -> None:
        if self.state_slots is not None:
            self.state_slots.release(seq.seq_id)
        if seq.lora is not None:
            self._slots().release(seq.lora_slot)
            seq.lora_slot = 0

    def _schedule(
        self,
        seq: TokenSequence,
        num_new: int,
        out: SchedulerOutput,
        scheduled: set[str],
        draft: Sequence[int] = (),
        rerun: int = 0,
    ) -> None:
        """Record `num_new` tokens (and `draft`) of `seq`, already allocated (so its computed count already
        includes the new tokens), after the `rerun` computed tokens before them its state recomputes."""
        scheduled.add(seq.seq_id)
        end = self.kv.num_computed_tokens(seq.seq_id)
        item = ScheduledSeq(seq, end - num_new - rerun, num_new + rerun, list(draft), rerun=rerun)
        if seq.needs_prompt_logprobs:
            assert item.start <= seq.prompt_logprobs_done, (item.start, seq.prompt_logprobs_done)
            stop = min(end, len(seq.prompt_token_ids) - 1)
            if stop > seq.prompt_logprobs_done:
                item.prompt_logprob_positions = range(seq.prompt_logprobs_done, stop)
                seq.prompt_logprobs_done = stop
        if seq.pooling is not None:
            item.pool_positions = seq.pool_positions(end)
        out.scheduled.append(item)
        self._save_snapshot(seq, item.start, end)
        if end < seq.num_tokens or seq.pooling is not None:  # a prompt chunk short of the last token, or an
            return  # embedding's prompt (pooled, never sampled), samples nothing
        index = len(out.scheduled) - 1
        out.sample_rows.append(SampleRow(seq, index))
        out.sample_rows.extend(SampleRow(seq, index, tuple(draft[:j])) for j in range(1, len(draft) + 1))
        for child in seq.forked_children:  # the prompt completes now: children share its pages
            self.kv.fork(seq.seq_id, child.seq_id)
            child.num_cached_prompt = seq.num_cached_prompt
            child.status = Status.RUNNING
            self._take_slot(child, out, parent=seq)  # the leader's adapter: resident, so never a load
            scheduled.add(child.seq_id)
            self.running.append(child)
            out.sample_rows.append(SampleRow(child, index))
        seq.forked_children = []

    def _preempt(self, victim: TokenSequence, out: SchedulerOutput) -> None:
        """Stop `victim`: swapped out when the swap space takes it (`paged_jax.kv_cache.swap`; never an embedding,
        whose last prompt token is computed), else its pages are freed and it recomputes."""
        victim.draft_token_ids = []
        self.running.remove(victim)
        if self.swap is None or victim.pooling is not None or not self.swap.swap_out(victim.seq_id):
            self.kv.free(victim.seq_id)
        self._release_slot(victim)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

"""Speculative decoding on Qwen3.5 (Gated DeltaNet + full attention): a verify that rejects a draft has run the
rejected tokens into the linear layers' recurrent state, so the state is restored from the checkpoint row taken
before the verify and the kept tokens are re-run in the next step (`paged_jax.kv_cache.state_pool`).

Greedy tokens with speculation equal transformers' (which plain decoding equals, test_qwen3_5_engine) when a
drafter whose drafts the test controls makes every verify keep all, none or some of its drafts, in chunked mixed
steps under preemption and with an abort while a re-run is pending; with the real n-gram drafter, and with prefix
hits (the same cached tokens as without speculation). Every step checks the KV manager's and the state slots'
invariants; every page and slot is free at the end; warmed up, nothing compiles."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.config import ConfigError
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.proposer import DraftRequest
from paged_jax.spec_decode.stats import SpecStats
from paged_jax.worker.warmup import GREEDY as GREEDY_FLAGS
from paged_jax.worker.warmup import WarmupPlan

from support.hf_golden import DATA, load_golden

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
K = 3
# Speculation that never pauses (no cost gate: timing must not decide which steps speculate) with k fixed.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "adaptive_k": False,
    "pause_by_cost": False,
    "min_acceptance_rate": 0.0,
}


def make_llm(name: str, spec: dict | None = SPEC, **options) -> LLM:
    kwargs = dict(
        dtype="float32",
        page_size=8,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=9,
        chunk_size=5,  # odd prefill chunks beside the verifies and re-runs
        warmup=False,
        speculative_config=spec,
    )
    return LLM(str(DATA / f"hf_{name}"), **(kwargs | options))


class ScriptedDrafter:
    """Drafts from each prompt's known greedy continuation (`want`), spoiled in turn so that the verifies keep all
    of them, none (the first is wrong) and some (the second is wrong)."""

    def __init__(self, want: dict[tuple[int, ...], list[int]], vocab_size: int) -> None:
        self.want, self.vocab_size, self.calls = want, vocab_size, 0

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            seq = r.seq
            draft = self.want[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :][: r.max_drafts]
            wrong = (None, 0, 1)[self.calls % 3]
            self.calls += 1
            if wrong is not None and wrong < len(draft):
                draft[wrong] = (draft[wrong] + 1) % self.vocab_size
            out.append(draft)
        return out

    def release(self, seq_id: str) -> None:
        pass


class RecordingStats(SpecStats):
    """The speculation counters, also keeping (drafts, kept) of every verify the engine settles."""

    def __init__(self) -> None:
        super().__init__()
        self.verifies: list[tuple[int, int]] = []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verifies.append((num_drafts, num_accepted))
        super().record(num_drafts, num_accepted)


def record_verifies(llm: LLM) -> list[tuple[int, int]]:
    """(drafts, kept) of every verify the engine settles from now on."""
    stats = llm.engine.spec.stats = RecordingStats()
    return stats.verifies


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, abort_rerun: bool = False, salt=None):
    """Every request to the end, the invariants checked after each step; each request's final output by index
    (`abort_rerun`: the first request whose state waits for a re-run is aborted then, and left out)."""
    engine = llm.engine
    base = engine.num_steps
    slots = engine.scheduler.state_slots
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{base}.{i}", prompt, params, cache_salt=salt)
    done, aborted = {}, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
        if abort_rerun and aborted is None:
            behind = [s for s in engine.scheduler.running if slots.rerun_tokens(s.seq_id)]
            if behind:
                aborted = behind[0].request_id
                engine.abort(aborted)
                engine.check_invariants()
    engine.check_invariants()
    st = engine.kv.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    assert slots.num_in_use == 0 and slots.num_free == slots.num_slots - 1  # every slot back
    assert slots.take_checkpoints() == []  # no rollback left for a slot nobody owns
    assert not abort_rerun or aborted is not None
    return {i: done[f"r{base}.{i}"] for i in range(len(prompts)) if f"r{base}.{i}" != aborted}


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_verifies_that_keep_all_none_or_some_drafts_give_the_plain_greedy_tokens(name):
    """8 pages of 8 tokens for 4 sequences of up to 39: preemption, with its recompute, while drafts are verified.
    The dense model is warmed up first, and then nothing compiles (verifies, re-runs and state copies included):
    the warm-up of every step shape makes it the long one (about 20 s on a loaded 2-core CPU)."""
    golden = load_golden(DATA / f"hf_{name}")
    llm = make_llm(name, num_pages=8, async_scheduling=False)  # a re-run is pending when a step call returns
    engine = llm.engine
    warm = name == "qwen3_5"
    if warm:
        engine.warmup(WarmupPlan(sampler_flags=(GREEDY_FLAGS,), lookahead=False, copies=False), progress=False)
    compiled = engine.runner.compile_stats.count
    want = {tuple(p.tolist()): g.tolist() for p, _, g in golden}
    engine.spec.proposer = ScriptedDrafter(want, engine.config.vocab_size)
    verifies = record_verifies(llm)
    got = run(llm, [p.tolist() for p, _, _ in golden], GREEDY, abort_rerun=True)
    assert len(got) == len(golden) - 1
    for i, out in got.items():
        assert list(out.outputs[0].token_ids) == golden[i][2].tolist(), (name, i)
    kept = {kept for k, kept in verifies if k == K}
    assert {0, 1, K} <= kept, kept  # none, some and all of the drafts kept
    assert engine.scheduler.state_slots.num_rollbacks == sum(kept < k for k, kept in verifies)
    assert engine.scheduler.num_preemptions > 0
    if warm:
        assert engine.stats().compiles_after_warmup == 0 and engine.runner.compile_stats.count == compiled


def test_ngram_speculation_with_prefix_hits_equals_decoding_without_it():
    """The real n-gram drafter (with the lookahead between its verifies) against the same engine's requests that
    opt out of speculation, each under its own cache salt: the same tokens and the same prefix hits (the snapshot
    at 40 of an earlier 45-token prompt). The tiny random model never copies its prompt, so each of its drafts is
    rejected and each verify rolls back (what verifies keep is the scripted drafter's test)."""
    llm = make_llm("qwen3_5")
    verifies = record_verifies(llm)
    rng = np.random.default_rng(2)
    base = rng.integers(3, 288, size=45).tolist()
    prompts = [base + rng.integers(3, 288, size=n).tolist() for n in (3, 5)] + [base]
    outputs = {}
    for speculate in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=16, speculate=speculate)
        run(llm, [base], params, salt=str(speculate))
        got = list(run(llm, prompts, params, salt=str(speculate)).values())
        assert [o.metrics.num_cached_prompt_tokens for o in got] == [40, 40, 40]
        outputs[speculate] = [list(o.outputs[0].token_ids) for o in got]
    assert outputs[True] == outputs[False]
    assert verifies and llm.engine.scheduler.state_slots.num_rollbacks == sum(kept < k for k, kept in verifies)


def test_the_checkpoint_rows_are_part_of_the_state_pool_budget():
    """One checkpoint row per slot after the snapshot rows, paid from the same CPU budget as the pages."""
    from paged_jax.model.linear_state import LinearState
    from paged_jax.worker.linear_state import state_pool_bytes

    engine = make_llm("qwen3_5", num_pages=None, cpu_kv_cache_bytes=2**18, max_model_len=256).engine
    pool = sum(x.nbytes for c in engine.runner.kv_caches if isinstance(c, LinearState) for x in (c.conv, c.recurrent))
    assert pool == state_pool_bytes(engine.config, 4, 4 + 4)  # 4 slots + null, 4 snapshot rows, 4 checkpoints
    assert engine.scheduler.state_slots.checkpoint_row == 4 + 1 + 4


def test_a_draft_model_is_refused_by_name():
    with pytest.raises(ConfigError, match='^speculative_config.method: "draft_model" .*qwen3_5'):
        make_llm("qwen3_5", spec={"method": "draft_model", "model": str(DATA / "hf_qwen3_5")})

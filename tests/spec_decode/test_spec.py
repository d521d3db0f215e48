"""Speculative decoding (paged_jax.spec_decode): drafts change how many tokens a step yields, never which tokens.

Greedy and seeded sampled outputs with speculation equal those without it, token for token (and logprob for
logprob), under preemption, prefix sharing, n > 1, stops and mixed lengths; the rejection rule keeps the target's
distribution (a chi-square test that a deliberately wrong rule fails); no page holds a draft once a step ends.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from paged_jax.config.speculative import SpeculativeConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.kv_cache import KVCacheManager
from paged_jax.kv_cache.invariants import check_manager_invariants
from paged_jax.sampling_params import SamplingParams
from paged_jax.spec_decode.cost import CostGate, bucket_of
from paged_jax.spec_decode.decoder import next_draft_len
from paged_jax.spec_decode.ngram import NgramProposer
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample
from paged_jax.worker.spec_verify import REJECTED, mask_rejected
from paged_jax.worker.step_inputs import SamplerFlags
from paged_jax.worker.warmup import GREEDY, WarmupPlan

from support.engines import make_engine as _make_engine

ROOT = Path(__file__).resolve().parents[2]


def make_engine(tiny_config, tiny_params, spec: dict | None, **options) -> LLMEngine:
    return _make_engine(tiny_config, tiny_params, speculative_config=spec, **options)


def workload(seed: int, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt lengths, a shared prefix for half of them, repeats inside prompts (so lookups hit), n > 1,
    stop ids and stop strings, short and long outputs."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 259, 40).tolist()
    prompts, params = [], []
    for i in range(n):
        body = rng.integers(3, 259, int(rng.integers(1, 60))).tolist()
        prompt = (shared if i % 2 else []) + body + body[: int(rng.integers(0, len(body) + 1))]
        prompts.append(prompt)
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=int(rng.integers(1, 40)),
                n=2 if i % 5 == 0 else 1,
                stop_token_ids=[int(rng.integers(3, 259))] if i % 3 == 0 else [],
                stop=["ab"] if i % 4 == 0 else [],
            )
        )
    return prompts, params


def run(engine: LLMEngine, prompts, params, arrive_every: int = 1) -> dict[str, list]:
    """Requests arrive one every `arrive_every` steps (0: all at the start); returns each request's (token ids,
    text, finish reason, logprobs) per sample."""
    pending = list(enumerate(zip(prompts, params, strict=True)))
    results: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and (arrive_every == 0 or step % arrive_every == 0):  # 0: all at once
            i, (prompt, p) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, p)
            if arrive_every:
                break
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [
                    (c.token_ids, c.text, c.finish_reason, [(lp.logprob, lp.top) for lp in c.logprobs or []])
                    for c in out.outputs
                ]
        check_manager_invariants(engine.kv)
        step += 1
    stats = engine.kv.stats()
    assert stats.pages_in_use == 0 and stats.pages_free == stats.pages_total
    return results


@pytest.fixture(scope="module")
def greedy_baseline(tiny_config, tiny_params):
    prompts, params = workload(1, 16)
    return prompts, params, run(make_engine(tiny_config, tiny_params, None, num_pages=24), prompts, params)


def record_asks(engine: LLMEngine) -> list[tuple[int, int]]:
    """Wrap the engine's proposer: each request's (drafts asked for, drafts the sequence has room for)."""
    asks, propose = [], engine.spec.proposer.propose

    def recording(requests):
        asks.extend((r.max_drafts, engine.spec._room(r.seq)) for r in requests)
        return propose(requests)

    engine.spec.proposer.propose = recording
    return asks


@pytest.mark.parametrize(("k", "adaptive"), [(1, True), (3, False), (5, True)])
@pytest.mark.parametrize("lookahead", [True, False], ids=["async", "sync"])
def test_greedy_output_is_unchanged(tiny_config, tiny_params, greedy_baseline, k, adaptive, lookahead):
    """Also: a fixed draft length asks every sequence for all the drafts it has room for; an adaptive one asks
    for fewer after a rejection."""
    prompts, params, want = greedy_baseline
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "adaptive_k": adaptive}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24, async_scheduling=lookahead)
    asks = record_asks(engine)
    assert run(engine, prompts, params) == want
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0  # the workload exercised both
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert len(stats.spec_acceptance_per_position) == k
    shrunk = [asked < room for asked, room in asks]
    assert any(shrunk) == (adaptive and k > 1) and all(asked <= room for asked, room in asks)


def test_adaptive_draft_length_rule():
    """Twice the drafts after keeping them all (at most k), one more than kept after a rejection."""
    cases = {(1, 1): 2, (2, 2): 4, (4, 4): 7, (7, 7): 7, (7, 0): 1, (7, 3): 4, (2, 1): 2}  # (drafted, kept): next
    assert {case: next_draft_len(*case, 7) for case in cases} == cases
    assert next_draft_len(3, 3, 3) == 3 and next_draft_len(1, 0, 1) == 1


def test_misses_pause_without_doubling_low_acceptance_doubles(tiny_config, tiny_params):
    """A sequence with no proposal for `max_misses` steps pauses `pause_tokens`, the same each time (a step
    without drafts scores nothing extra); asks resume at fixed intervals of output tokens."""
    spec = {"method": "ngram", "max_misses": 2, "pause_tokens": 3, "pause_by_cost": False}
    engine = make_engine(tiny_config, tiny_params, spec, async_scheduling=False)
    asked_at = []

    def never(requests):
        asked_at.extend(len(r.seq.output_token_ids) for r in requests)
        return [[] for _ in requests]

    engine.spec.proposer.propose = never
    engine.add_request("r", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert asked_at == [1, 2, 5, 6, 9, 10, 13, 14, 17, 18]


def test_seeded_sampling_is_unchanged(tiny_config, tiny_params):
    """Point-mass drafts accept iff the target's own draw equals them, so a seeded request draws the same tokens
    (and logprobs) as without speculation: penalties, top-k/p, min_tokens and logprobs see the drafts as history."""
    prompts, params = workload(2, 10)
    params = [
        SamplingParams(
            temperature=0.8,
            top_k=20 if i % 2 else 0,
            top_p=0.9,
            max_tokens=p.max_tokens + 5,
            seed=i,
            n=p.n,
            min_tokens=3,
            repetition_penalty=1.2 if i % 3 == 0 else 1.0,
            frequency_penalty=0.3 if i % 4 == 0 else 0.0,
            logprobs=2 if i % 2 == 0 else None,
        )
        for i, p in enumerate(params)
    ]
    want = run(make_engine(tiny_config, tiny_params, None, num_pages=24), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    got = run(engine, prompts, params)
    assert engine.stats().spec_draft_tokens > 0
    assert_same(got, want)


def assert_same(got: dict[str, list], want: dict[str, list]) -> None:
    """Tokens, text and finish reasons exactly; logprobs to float32 rounding (a verify step computes a position
    among others of its sequence, a plain step alone: the sums may round differently)."""
    strip = {r: [c[:3] for c in cs] for r, cs in want.items()}
    assert {r: [c[:3] for c in cs] for r, cs in got.items()} == strip
    for r, cs in want.items():
        for c, g in zip(cs, got[r], strict=True):
            assert [t for _, top in g[3] for t, _ in top] == [t for _, top in c[3] for t, _ in top]
            flat = [[lp, *(v for _, v in top)] for lp, top in c[3]]
            assert np.allclose([[lp, *(v for _, v in top)] for lp, top in g[3]], flat, atol=1e-4, rtol=0)


def test_draft_model_greedy_output_is_unchanged(tiny_config, tiny_params, greedy_baseline):
    """A w8a8 copy of the target as the draft (its own runner, KV pool and prefix cache): the output is the
    target's, most drafts are kept, and the draft's pool is empty once every request is done."""
    prompts, params, want = greedy_baseline
    spec = {"method": "draft_model", "model": "tiny", "quantization": "w8a8", "num_speculative_tokens": 3}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    assert run(engine, prompts, params) == want
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_acceptance_rate > 0.8
    draft_kv = engine.spec.proposer.kv
    check_manager_invariants(draft_kv)
    assert draft_kv.stats().pages_in_use == 0


def test_draft_model_must_fit_the_target(tiny_config, tiny_params, tmp_path):
    import json

    other = json.loads((ROOT / "configs" / "tiny.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(other | {"vocab_size": 256}))
    (tmp_path / "short.json").write_text(json.dumps(other | {"max_position_embeddings": 64}))
    base = {"method": "draft_model", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary has 256 tokens"):
        make_engine(tiny_config, tiny_params, base | {"model": str(tmp_path / "vocab.json")})
    with pytest.raises(ValueError, match="speculative_config.model: the draft reaches 64 positions"):
        make_engine(tiny_config, tiny_params, base | {"model": str(tmp_path / "short.json")}, max_model_len=128)


# -- the rejection rule, on the device's own code -------------------------------------------------------------------
VOCAB = 6
DRAWS = 12000


def _verify_draws(rows_logits: np.ndarray, drafts: list[int], temperature: float) -> np.ndarray:
    """DRAWS seeded verify steps of one sequence with drafts `drafts` over rows_logits [k + 1, V]: the sampler on
    every row (seed i, output position j), then `mask_rejected`. Returns tokens [DRAWS, k + 1] (REJECTED: not kept)."""
    rows = len(drafts) + 1
    s = DRAWS * rows
    m = SamplingMeta(**empty_meta(s))
    m.temperature[:] = temperature
    m.seed[:, 0] = np.repeat(np.arange(DRAWS, dtype=np.uint32), rows)
    m.step[:] = np.tile(np.arange(rows), DRAWS)
    logits = np.tile(rows_logits, (DRAWS, 1)).astype(np.float32)
    tokens = sample(logits, m, do_sample=True, do_filter=False, do_penalty=False, want_logprobs=False).tokens
    next_draft = np.tile(np.array([*drafts, -1], np.int32), DRAWS)
    row_start = np.repeat(np.arange(DRAWS, dtype=np.int32) * rows, rows)
    return np.asarray(mask_rejected(tokens, next_draft, row_start)).reshape(DRAWS, rows)


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    keep = expected > 0
    return scipy_stats.chisquare(observed[keep], expected[keep]).pvalue


def _check(out: np.ndarray, probs: np.ndarray, drafts: list[int]) -> list[float]:
    """p-values of: row j's kept tokens against p_j, among the draws that kept drafts 0..j-1."""
    pvalues = []
    alive = np.ones(len(out), bool)
    for j in range(len(drafts) + 1):
        kept = out[alive, j]
        assert (kept != REJECTED).all()
        pvalues.append(_chi2_pvalue(np.bincount(kept, minlength=VOCAB), probs[j]))
        if j < len(drafts):
            alive &= out[:, j] == drafts[j]
            assert ((out[:, j + 1] != REJECTED) == alive).all()
    return pvalues


def test_rejection_rule_keeps_the_target_distribution():
    """Each kept token is distributed as the target's p at its position (conditioned on the drafts before it
    being kept), while a textbook bug (on rejection, resample from p instead of from p without the draft) is
    caught by the same statistic at the same number of draws."""
    rng = np.random.default_rng(0)
    temperature = 0.7
    rows_logits = rng.normal(0, 1.5, (3, VOCAB))
    probs = np.exp(rows_logits / temperature)
    probs /= probs.sum(-1, keepdims=True)
    drafts = [int(np.argsort(probs[0])[-2]), int(np.argmax(probs[1]))]  # a likely and a less likely draft
    out = _verify_draws(rows_logits, drafts, temperature)
    assert min(_check(out, probs, drafts)) > 1e-3
    # The wrong rule: accept the draft with probability p(x), else emit a fresh draw from p (which can be x again).
    u = rng.random(DRAWS)
    fresh = np.array([rng.choice(VOCAB, p=probs[0]) for _ in range(DRAWS)])
    wrong_first = np.where(u < probs[0, drafts[0]], drafts[0], fresh)
    assert _chi2_pvalue(np.bincount(wrong_first, minlength=VOCAB), probs[0]) < 1e-6


def test_greedy_rows_keep_the_longest_matching_prefix():
    tokens = np.array([5, 7, 9, 4, 4, 8, 1, 2], np.int32)  # seq A rows 0-3 (drafts 5, 7, 1), B row 4, C rows 5-7
    next_draft = np.array([5, 7, 1, -1, -1, 3, 2, -1], np.int32)
    row_start = np.array([0, 0, 0, 0, 4, 5, 5, 5], np.int32)
    got = np.asarray(mask_rejected(tokens, next_draft, row_start))
    assert got.tolist() == [5, 7, 9, REJECTED, 4, 8, REJECTED, REJECTED]


# -- the KV manager's side ----------------------------------------------------------------------------------------
def test_drafts_get_slots_are_never_hashed_and_roll_back():
    m = KVCacheManager(num_pages=11, page_size=8)
    tokens = list(range(100, 110))
    assert m.admit("a", tokens, 10) == 0  # pages 1, 2; 10 computed
    tokens.append(7)  # the sampled token: computed next step with 9 drafts -> positions 10..19, pages 2, 3
    assert m.allocate_slots("a", tokens, 1, num_draft=9) == []
    assert m.page_ids("a") == [1, 2, 3] and m.num_computed_tokens("a") == 11 and m.num_draft_slots("a") == 9
    assert len(m.pool.cached) == 1  # block 0 only: block 1 holds drafts until they are settled
    check_manager_invariants(m)
    tokens += [1, 2, 3]  # drafts 0-1 accepted, then the bonus token
    m.accept_drafts("a", 2, tokens)
    assert m.page_ids("a") == [1, 2] and m.num_computed_tokens("a") == 13 and m.num_draft_slots("a") == 0
    assert m.free_page_ids()[0] == 3  # the page only rejected drafts needed goes back first
    check_manager_invariants(m)
    assert m.allocate_slots("a", tokens, 1, num_draft=3) == []  # positions 13..16: block 1 fills with drafts
    assert len(m.pool.cached) == 1
    tokens += [4, 5, 6, 8]
    m.accept_drafts("a", 3, tokens)  # all kept: block 1 is full of verified tokens now and is cached
    assert m.num_computed_tokens("a") == 17 and len(m.pool.cached) == 2
    check_manager_invariants(m)
    with pytest.raises(ValueError, match="drafts accepted"):
        m.accept_drafts("a", 1, tokens)
    m.free("a")
    check_manager_invariants(m)


def test_drafts_are_dropped_before_anyone_is_preempted(tiny_config, tiny_params):
    """Two sequences that fill the pool exactly (2 pages each): drafts that would need a fifth page are dropped,
    nobody is preempted, and the output is the plain one."""
    prompts = [list(range(3, 8)) * 2, list(range(20, 25)) * 2]  # 10 tokens each, repeats: every step has drafts
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    options = {"num_pages": 5, "page_size": 8, "max_model_len": 64, "watermark": 0}
    want = run(make_engine(tiny_config, tiny_params, None, **options), prompts, params, arrive_every=0)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, spec, **options)
    assert run(engine, prompts, params, arrive_every=0) == want
    stats = engine.stats()
    assert stats.num_preemptions == 0 and stats.spec_draft_tokens > 0


# -- the proposer and the config ------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(min_n=1, max_n=3, k=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert p.propose_one("a", tokens, 8) == [4, 5, 6]  # "1 2 3" last occurred before 4 5 6
    tokens += [4]
    assert p.propose_one("a", tokens, 8) == [5, 6, 1]  # extended incrementally: "2 3 4" is the longest match
    assert p.propose_one("a", tokens, 2) == [5, 6]  # capped by what the sequence may still take
    assert NgramProposer(1, 3, 3).propose_one("b", tokens, 8) == [5, 6, 1]  # the same from scratch
    assert p.propose_one("c", [7, 8, 9], 8) == []  # no earlier occurrence of any suffix
    assert NgramProposer(2, 3, 3).propose_one("d", [5, 1, 7, 1], 8) == []  # a 1-gram match is below min_n


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 2, "typo": 1}, "typo"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "model": "tiny"}, "model"),
        ({"min_acceptance_rate": 2.0}, "min_acceptance_rate"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"pause_by_cost": "yes"}, "pause_by_cost"),
        ({"cost_probe_steps": 0}, "cost_probe_steps"),
        ({"cost_margin": 1.0}, "cost_margin"),
        ({"adaptive_k": 1}, "adaptive_k"),
    ],
)
def test_bad_configs_name_the_field(tiny_config, tiny_params, config, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        make_engine(tiny_config, tiny_params, config)


def test_no_recompilation_in_steady_state(tiny_config, tiny_params):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    engine.warmup(
        WarmupPlan(sampler_flags=(GREEDY, SamplerFlags(True, False, False, False)), copies=False), progress=False
    )
    compiled = engine.runner.compile_stats.count
    prompts, params = workload(3, 12)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, max_tokens=p.max_tokens) for i, p in enumerate(params)]
    run(engine, prompts, params)
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.compiles_after_warmup == 0
    assert engine.runner.compile_stats.count == compiled


def test_cli_flag_and_batch_summary(tiny_config, tiny_params):
    import argparse

    from paged_jax.engine.args import add_engine_args, engine_config_from_args
    from paged_jax.offline.batch import BatchSummary

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2
    )
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(argparse.ArgumentError, match="speculative-config"):
            parser.parse_args(["--speculative-config", bad])
    engine = make_engine(
        tiny_config, tiny_params, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    )
    prompts, params = workload(1, 6)
    run(engine, prompts, params)
    summary = BatchSummary(
        spec={
            k: getattr(engine.stats(), k)
            for k in (
                "spec_drafts",
                "spec_draft_tokens",
                "spec_accepted_tokens",
                "spec_acceptance_rate",
                "spec_mean_accepted_length",
                "spec_acceptance_per_position",
            )
        }
    )
    (line,) = summary.spec_lines()
    assert line.startswith("speculation") and "by position" in line


# -- opting out, and pausing where speculation costs more than it yields ------------------------------------


def test_a_request_can_opt_out_of_speculation(tiny_config, tiny_params, greedy_baseline):
    """`speculate=False` requests get no drafts (and the same tokens); the others in the batch still speculate."""
    prompts, params, want = greedy_baseline
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "pause_by_cost": False}
    off = [dataclasses.replace(p, speculate=False) for p in params]
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    assert run(engine, prompts, off) == want
    assert engine.stats().spec_draft_tokens == 0
    mixed = [dataclasses.replace(p, speculate=bool(i % 2)) for i, p in enumerate(params)]
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    assert run(engine, prompts, mixed) == want
    assert engine.stats().spec_draft_tokens > 0
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate=1).validate()


def test_the_cost_gate_pauses_a_batch_size_where_speculating_is_slower():
    """Synthetic timings: with plain decoding unmeasured the gate first measures it; speculation slower than
    plain pauses it for pause_steps, doubling while it keeps losing; a win resets the doubling; batch sizes are
    measured apart; the first step after a change of mode is not counted."""
    gate = CostGate(probe_steps=2, pause_steps=4, refresh_steps=100)

    def steps(n: int, speculating: bool, rate: float, seqs: int = 1) -> None:
        for _ in range(n):
            assert gate.allows(seqs) == speculating
            gate.observe(seqs, speculating, 10, 10 / rate)

    steps(2, True, 80.0)  # 2 speculating steps at 80 tok/s: plain unknown, so measure it
    steps(3, False, 100.0)  # the first of these is the switch (not counted), then 2 plain ones at 100 tok/s
    costs = gate.buckets[1]
    assert costs.plain_rate == pytest.approx(100.0) and costs.spec_rate == pytest.approx(80.0)
    steps(3, True, 80.0)  # switch + 2 counted: slower than plain -> pause for 4 steps
    assert costs.pauses == 1
    steps(4, False, 100.0)
    steps(3, True, 80.0)  # loses again: the pause doubles
    assert costs.pauses == 2 and costs.paused_until == gate.step + 8
    steps(8, False, 100.0)
    steps(8, True, 1000.0)  # now it wins: no pause, the doubling is reset
    assert gate.allows(1) and costs.factor == 1
    assert gate.allows(32) and 32 not in gate.buckets  # a batch size of its own, not yet measured
    assert bucket_of(1) == 1 and bucket_of(3) == 4 and bucket_of(32) == 32


def test_a_badly_losing_batch_size_is_probed_rarely():
    """Speculating steps 4x as long as plain ones for 2x the tokens (half the rate): a probe of 2 steps loses
    4 plain steps' time (8 x 0.5), so with a 10% margin the pause is (4 / 0.1 - 8) / 1 = 32 plain steps, not
    the pause_steps (4) of a narrow loss."""
    gate = CostGate(probe_steps=2, pause_steps=4, refresh_steps=1000, margin=0.1)
    for speculating, tokens, seconds, n in [(True, 2, 4.0, 2), (False, 1, 1.0, 3), (True, 2, 4.0, 3)]:
        for _ in range(n):
            gate.observe(1, speculating, tokens, seconds)
    assert gate.buckets[1].pauses == 1 and gate.buckets[1].paused_until == gate.step + 32


def test_the_cost_gate_weighs_rates_by_time():
    """Tokens over seconds of the recent steps, not an average of per-step rates: 10 tokens in 1 s, then 10 in
    0.1 s, are 10 tokens per 0.73 s of EMA time (13.7 tok/s; an EMA of the rates would say 37)."""
    gate = CostGate(probe_steps=100, pause_steps=4, refresh_steps=100)
    gate.observe(1, True, 10, 1.0)
    gate.observe(1, True, 10, 0.1)
    assert gate.buckets[1].spec_rate == pytest.approx(10 / (0.7 * 1.0 + 0.3 * 0.1))


@pytest.mark.parametrize(("spec_rate", "paused"), [(95.0, False), (85.0, True)])
def test_the_cost_gate_pauses_only_beyond_its_margin(spec_rate, paused):
    """With a 10% margin, speculation measured 5% slower than plain keeps speculating (noise), 15% slower pauses."""
    gate = CostGate(probe_steps=2, pause_steps=4, refresh_steps=100, margin=0.1)
    for speculating, rate, n in [(True, spec_rate, 2), (False, 100.0, 3), (True, spec_rate, 3)]:
        for _ in range(n):
            gate.observe(1, speculating, 10, 10 / rate)
    assert gate.buckets[1].pauses == int(paused) and gate.allows(1) != paused


def test_the_engine_feeds_the_gate_and_a_paused_batch_keeps_the_lookahead(tiny_config, tiny_params, greedy_baseline):
    prompts, params, want = greedy_baseline
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    assert run(engine, prompts, params) == want
    gate = engine.spec.gate
    assert gate.step > 0 and any(c.spec_rate is not None for c in gate.buckets.values())
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    engine.spec.gate.allows = lambda num_seqs: False  # every batch size paused
    synced = []
    needs_sync = engine.spec.needs_sync
    engine.spec.needs_sync = lambda *a: synced.append(needs_sync(*a)) or synced[-1]
    assert run(engine, prompts, params) == want
    assert engine.stats().spec_draft_tokens == 0 and synced and not any(synced)


def test_a_step_that_compiled_does_not_feed_the_gate(tiny_config, tiny_params, greedy_baseline):
    """A step call that compiled an executable (a shape's first use without warm-up) is not timed: its compile
    seconds would read as decoding cost and pause speculation. Here every launch counts as a compile."""
    from paged_jax.worker.executables import PROCESS

    prompts, params, want = greedy_baseline
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = make_engine(tiny_config, tiny_params, spec, num_pages=24)
    launch = engine.launch_step

    def compiling_launch(*args, **kwargs):
        with PROCESS.lock:
            PROCESS.backend_compiles += 1
        return launch(*args, **kwargs)

    engine.launch_step = compiling_launch
    assert run(engine, prompts, params) == want
    assert engine.spec.gate.step == 0 and engine.stats().spec_draft_tokens > 0
    engine.launch_step = launch
    assert run(engine, prompts, params) == want
    assert engine.spec.gate.step > 0


def test_the_fronts_carry_the_opt_out():
    """OpenAI bodies (`"speculate": false`) and gRPC `SamplingParams.speculate` reach the sampling fields."""
    from serve.convert import sampling_fields
    from serve.openai_api.protocol import parse_body
    from serve.proto.paged_jax.v1 import generate_pb2 as pb

    assert parse_body(b'{"prompt": "hi", "speculate": false}', "completion").generates[0].sampling == {
        "speculate": False
    }
    assert "speculate" not in parse_body(b'{"prompt": "hi"}', "completion").generates[0].sampling
    assert sampling_fields(pb.SamplingParams(speculate=False)) == {"speculate": False}
    assert sampling_fields(pb.SamplingParams()) == {}

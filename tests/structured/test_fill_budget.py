"""The per-step budget of a constrained row's host work (`EngineConfig.structured_fill_budget_s`): a row whose
mask fill or grammar advance passes it ends with finish_reason "error", every other row goes on, and nothing
leaks.

The hostile grammar is one the up-front regex bound would refuse (nested counted repetitions), let through
here with the bound lifted: each of its masks costs tens of milliseconds of native work on the tiny model's
byte vocabulary, a hundred times the 0.2 ms budget the test sets, so no machine is fast enough to fill it in
time; the victim is unconstrained (it needs no fill), so nothing in the test depends on how fast a clean fill
is. The advance's budget is tested with an injected clock."""

from __future__ import annotations

import itertools
from functools import partial

import pytest

from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.structured import LLGuidanceBackend, StructuredLimits
from paged_jax.structured.rows import StructuredRows
from paged_jax.tokenization.tokenizer import ByteTokenizer

from support.engines import make_engine as _make_engine
from support.engines import run_requests

HOSTILE = "(a{300}){300}"  # ~0.3 s to compile with its first mask, then 10-40 ms per mask (2-core CPU)
make_engine = partial(_make_engine, max_num_seqs=8)


def _lift_regex_bound(engine) -> None:
    """The engine's grammar backend without the regex expansion bound (and a compile deadline no machine misses),
    so the hostile grammar reaches the steps."""
    engine.structured.backend.limits = StructuredLimits(max_regex_expansion=10**9, compile_timeout_s=600)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_row_past_the_fill_budget_ends_with_error_and_the_others_go_on(tiny_config, tiny_params, async_scheduling):
    """Beside a victim (greedy, unconstrained) and a hostile request with n=2: both hostile samples end with
    "error" and the budget named; the victim's tokens are those of its solo run; every page is back."""
    victim = ([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    solo = run_requests(make_engine(tiny_config, tiny_params, async_scheduling=async_scheduling), {"v": victim})
    engine = make_engine(tiny_config, tiny_params, async_scheduling=async_scheduling, structured_fill_budget_s=0.0002)
    _lift_regex_bound(engine)
    hostile = SamplingParams(max_tokens=12, n=2, structured_outputs=StructuredOutputs(regex=HOSTILE))
    finals = run_requests(engine, {"v": victim, "h": ([8, 9], hostile)})
    assert finals["v"].outputs[0].token_ids == solo["v"].outputs[0].token_ids
    assert finals["v"].outputs[0].finish_reason == "length"
    for c in finals["h"].outputs:
        assert c.finish_reason == "error", c
        assert "budget of 0.0002 s per step" in str(c.stop_reason) and "structured_fill_budget_s" in str(c.stop_reason)
        assert set(c.token_ids) <= {3 + ord("a")}  # what came before the late fill obeyed the grammar
    assert engine.structured.late_rows == 2
    assert engine.kv.stats().pages_in_use == 0
    engine.check_invariants()


def test_without_a_budget_the_hostile_row_is_filled_however_long_it_takes(tiny_config, tiny_params):
    """The control: no budget (None), so the same hostile row is filled every step and ends by its length."""
    engine = make_engine(tiny_config, tiny_params, structured_fill_budget_s=None)
    _lift_regex_bound(engine)
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputs(regex=HOSTILE))
    out = run_requests(engine, {"h": ([8, 9], params)})["h"].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == [3 + ord("a")] * 3
    assert engine.structured.late_rows == 0


def test_an_advance_past_the_budget_ends_its_row(tiny_config, tiny_params):
    """`StructuredRows.advance` timed by an injected clock that moves 1 s per reading: past a 0.5 s budget the
    row ends (the message names the budget); within a 2 s budget, or with the real clock, it goes on."""
    backend = LLGuidanceBackend(ByteTokenizer(), 320, (2,))
    ticks = itertools.count()
    slow = StructuredRows(backend, budget_s=0.5, clock=lambda: float(next(ticks)))
    matcher = slow.matchers(StructuredOutputs(regex="[0-9]+"), 1)[0]
    assert "budget of 0.5 s per step" in slow.advance(matcher, 3 + ord("1"))
    assert slow.late_rows == 1
    roomy = StructuredRows(backend, budget_s=2.0, clock=lambda: float(next(ticks)))
    assert roomy.advance(matcher, 3 + ord("2")) is None
    assert StructuredRows(backend, budget_s=0.5).advance(matcher, 3 + ord("3")) is None
    refused = StructuredRows(backend, budget_s=0.5).advance(matcher, 3 + ord("x"))
    assert refused.startswith("structured output: ") and "budget" not in refused

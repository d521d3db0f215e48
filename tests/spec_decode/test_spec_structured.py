"""Structured output in an engine that speculates: a constrained request decodes without drafts (its mask follows
the grammar one sampled token at a time), the others speculate beside it, and every token is the one an engine
without speculation gives."""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.sampling_params import SamplingParams, StructuredOutputs

from support.engines import make_engine, run_requests

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "pause_by_cost": False}


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Each request's (token ids, finish reason) per sample; every page back and the invariants held after."""
    finals = run_requests(engine, requests)
    assert engine.kv.stats().pages_in_use == 0
    engine.check_invariants()
    return {rid: [(c.token_ids, c.finish_reason) for c in out.outputs] for rid, out in finals.items()}


def test_constrained_requests_decode_without_drafts_beside_speculating_ones(tiny_config, tiny_params):
    """Fails where the engine refuses structured output with speculation. Over 10 s on a loaded 2-core CPU: two
    engines compile their steps (one of them its verify steps)."""
    rng = np.random.default_rng(7)
    body = rng.integers(3, 259, 20).tolist()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    requests = {
        "free": (body * 3, greedy),  # repeats: the n-gram lookup finds drafts
        "regex": (body, dataclasses.replace(greedy, structured_outputs=StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"))),
        "json": (
            body[:5],
            dataclasses.replace(greedy, n=2, structured_outputs=StructuredOutputs(json={"type": "array"})),
        ),
    }
    want = _run(make_engine(tiny_config, tiny_params), requests)
    engine = make_engine(tiny_config, tiny_params, speculative_config=SPEC)
    assert _run(engine, requests) == want
    assert engine.stats().spec_draft_tokens > 0  # the free request speculated
    assert want["regex"][0][1] == "eos" and len(want["json"]) == 2
    assert requests["regex"][1].speculate  # the caller's params are left as they were


def test_a_leader_whose_prompt_completes_gets_no_drafts_before_it_forks(tiny_config, tiny_params):
    """n=2 with a prompt one token longer than the step's chunk: after the first chunk only its last prompt token is
    left, the step that computes it also forks the second sample, and a draft there was a ValueError ("fork ...
    while it holds unsettled drafts") that killed a server's engine loop. Tokens equal those without speculation."""
    body = list(range(10, 26))
    prompt = (body * 5)[:65]  # repeats: the n-gram lookup has drafts for it; 65 = the 64-token chunk + 1
    params = SamplingParams(max_tokens=8, n=2, temperature=0, ignore_eos=True)
    want = _run(make_engine(tiny_config, tiny_params), {"r": (prompt, params)})
    engine = make_engine(tiny_config, tiny_params, speculative_config=SPEC)
    assert _run(engine, {"r": (prompt, params)}) == want
    assert engine.stats().spec_draft_tokens > 0

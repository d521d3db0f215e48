"""A step's plan (`paged_jax.worker.step_plan`) carries all of it: a second runner that replays each plan from its
bytes (what a multi-host follower does) ends with the same KV pages and the same samples as the runner that ran the
steps, through prefix hits, copy-on-write forks, penalties, logprobs, prompt logprobs and the lookahead."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.sampling_params import SamplingParams
from paged_jax.worker.step_plan import CopyChunk, decode_plan, encode_plan

from support.engines import make_engine


def _leaves(tree) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_replayed_plans_give_the_same_pages_and_samples(tiny_config, tiny_params):
    leader = make_engine(tiny_config, tiny_params, num_pages=40)
    follower = make_engine(tiny_config, tiny_params, num_pages=40).runner
    sent: list[int] = []
    prev = {"samples": None}
    follower_tokens: list[np.ndarray] = []

    def mirror(plan) -> None:
        data = encode_plan(plan)
        sent.append(len(data))
        samples = follower.replay(decode_plan(data), prev["samples"])
        prev["samples"] = samples
        follower_tokens.append(np.asarray(samples.tokens))

    leader.runner.mirror = mirror
    leader_tokens: list[np.ndarray] = []
    collect = leader.runner.collect

    def recording_collect(out, *args, **kwargs):
        leader_tokens.append(np.asarray(out.tokens))
        return collect(out, *args, **kwargs)

    leader.runner.collect = recording_collect
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 259, 40).tolist()
    requests = [
        (shared + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)),  # a fork
        (shared + [10], SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, logprobs=2)),
        (rng.integers(3, 259, 70).tolist(), SamplingParams(max_tokens=7, ignore_eos=True, repetition_penalty=1.3)),
        (shared[:33], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)),
    ]
    leader.add_request("r0", *requests[0])
    leader.step()  # r0's prompt is cached before the others share it
    for i, (prompt, params) in enumerate(requests[1:], 1):
        leader.add_request(f"r{i}", prompt, params)
    while leader.has_unfinished():
        leader.step()
    assert len(sent) == len(leader_tokens) == len(follower_tokens) > 10
    for a, b in zip(leader_tokens, follower_tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(leader.runner.kv_caches), _leaves(follower.kv_caches), strict=True):
        np.testing.assert_array_equal(a, b)
    assert max(sent) < 200_000


def test_plan_bytes_are_checked():
    from paged_jax.worker.step_inputs import StepInputs
    from paged_jax.worker.step_plan import StepPlan

    z = np.zeros(4, np.int32)
    step = StepInputs(z, z, z, z, np.zeros((4, 2), np.int32), np.zeros(5, np.int32), z[:1], z, z - 1, z)
    plan = StepPlan([CopyChunk(z, z + 1)], 16, 4, None, step, False, None)
    data = encode_plan(plan)
    back = decode_plan(data)
    assert (back.t, back.s, back.has_prev, back.sampling) == (16, 4, False, None)
    np.testing.assert_array_equal(back.copies[0].dst, z + 1)
    with pytest.raises(ValueError, match="truncated"):
        decode_plan(data[:-3])
    with pytest.raises(ValueError, match="trailing"):
        decode_plan(data + b"x")
    bad = data.replace(b'"t":"CopyChunk"', b'"t":"PopenOpen"')  # same length
    with pytest.raises(ValueError, match="unknown record type 'PopenOpen'"):
        decode_plan(bad)
    with pytest.raises(TypeError, match="cannot carry a set"):
        encode_plan(StepPlan([], 16, 4, None, step, False, None, prompt={1}))  # type: ignore[arg-type]

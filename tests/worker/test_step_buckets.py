"""Every step a scheduler can form resolves to a sequence bucket that warm-up compiles (`StepBuckets`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.worker.buckets import StepBuckets, bucket_for


@st.composite
def steps(draw: st.DrawFn) -> tuple[StepBuckets, int, int, int]:
    """(buckets, token bucket, sequences scheduled, rows sampled) of one step: verify rows of speculating
    decodes (one row per token, 1 + drafts each), prompt chunks (none, or one row for a last chunk) and
    leaders of n > 1 requests whose last chunk samples one row per child; every sequence, children too, within
    `max_num_seqs`, every token within the step's budget."""
    m = draw(st.sampled_from([4, 8, 16]))
    k = draw(st.integers(0, 4))
    b = StepBuckets.make(m, draw(st.sampled_from([16, 32, 64])), k)
    budget = b.tokens[-1]
    tokens = seqs = rows = 0
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["verify", "chunk", "leader"]))
        n = draw(st.integers(1, 1 + k)) if kind == "verify" else draw(st.integers(1, 20))
        children = draw(st.integers(1, m)) if kind == "leader" else 0
        if tokens + n > budget or seqs + 1 + children > m:
            continue
        tokens, seqs = tokens + n, seqs + 1 + children
        rows += n if kind == "verify" else (1 + children if kind == "leader" else draw(st.integers(0, 1)))
    t = bucket_for(max(tokens, 1), b.tokens)
    return b, t, seqs, rows


@settings(max_examples=400, deadline=None)
@given(steps())
def test_every_step_with_forks_and_speculation_has_a_warmed_sequence_bucket(step) -> None:
    b, t, seqs, rows = step
    assert b.seq_bucket(t, max(seqs, rows)) in b.step_seq_buckets(t, forks=True)


def test_a_verify_batch_beside_a_short_prompt_with_n_4_needs_the_next_bucket() -> None:
    """14 verify tokens (rows) and a 2-token prompt sampling 4 children: 18 rows in a 16-token step."""
    b = StepBuckets.make(16, 64, 3)
    assert b.seq_bucket(16, 18) == 32
    assert 32 in b.step_seq_buckets(16, forks=True)
    assert b.step_seq_buckets(16) == [16]

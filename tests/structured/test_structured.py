"""Structured output on the tiny model (byte tokenizer): the device bitmask op, the llguidance backend, the
engine's matchers, and the guarantee that a constrained row never gets a token its grammar refuses.

The real-model checks (SmolLM2 and 20 JSON Schemas) are in test_structured_smollm2.py."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.sampling_params import SamplingParams, StructuredOutputs
from paged_jax.sched.sequence import FinishReason
from paged_jax.structured import GrammarError, LLGuidanceBackend, StructuredLimits
from paged_jax.structured.bitmask import all_allowed, apply_bitmask, bitmask_of, mask_words, unpack_bitmask
from paged_jax.tokenization.tokenizer import ByteTokenizer, HFTokenizer
from paged_jax.worker.sampler import SamplingMeta, empty_meta, sample
from paged_jax.worker.warmup import plan_for_requests
from pallas_kernels.common import MASK_VALUE

from support.engines import make_engine as _make_engine

V = 320  # the tiny config's vocabulary (the byte tokenizer's)
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe so"]


make_engine = partial(_make_engine, max_num_seqs=16)


def run(engine: LLMEngine, requests: dict[str, tuple[str | list[int], SamplingParams]]) -> dict[str, list]:
    """Add every request, step until done; request id -> its completions."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs
    assert engine.kv.stats().pages_in_use == 0
    engine.check_invariants()
    return out


def backend(vocab: int = V, **limits) -> LLGuidanceBackend:
    return LLGuidanceBackend(ByteTokenizer(), vocab, (2,), StructuredLimits(**limits))


def allowed_ids(b: LLGuidanceBackend, matcher) -> np.ndarray:
    mask = all_allowed(1, b.vocab_size)
    b.fill([(matcher, 0)], mask)
    return np.nonzero(np.asarray(unpack_bitmask(jnp.asarray(mask), b.vocab_size))[0])[0]


# -- the device op ----------------------------------------------------------------------------------------


def test_unpack_matches_numpy_bit_order():
    rng = np.random.default_rng(0)
    allowed = rng.random((5, 77)) < 0.3  # 77: the last word is partly past the vocabulary
    packed = bitmask_of(allowed)
    assert packed.shape == (5, mask_words(77)) == (5, 3) and packed.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(packed), 77)), allowed)
    words = np.zeros((1, 3), np.int32)
    words[0, 1] = 1 << 4  # bit 4 of word 1 is token 36
    assert np.nonzero(np.asarray(unpack_bitmask(jnp.asarray(words), 77))[0])[0].tolist() == [36]
    words[0, 2] = -1  # bits past the vocabulary (77..95) are ignored
    assert np.asarray(unpack_bitmask(jnp.asarray(words), 77)).sum() == 1 + (77 - 64)


def test_apply_bitmask_masks_and_leaves_all_ones_rows_exact():
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.normal(size=(4, 100)).astype(np.float32) * 5)
    allowed = rng.random((4, 100)) < 0.2
    allowed[2:] = True  # rows 2, 3 unconstrained
    out = np.asarray(jax.jit(apply_bitmask)(scores, jnp.asarray(bitmask_of(allowed))))
    np.testing.assert_array_equal(out, np.where(allowed, np.asarray(scores), MASK_VALUE))
    same = jax.jit(apply_bitmask)(scores, jnp.asarray(all_allowed(4, 100)))  # the lax.cond's skip branch
    np.testing.assert_array_equal(np.asarray(same), np.asarray(scores))


# -- the backend --------------------------------------------------------------------------------------------


def test_padded_vocabulary_tail_is_never_allowed():
    b = backend(vocab=V + 45)  # logits wider than the tokenizer (padded embedding rows)
    m = b.matcher(StructuredOutputs(regex="[a-z]*"))
    ids = allowed_ids(b, m)
    assert ids.max() < V and set(ids) == {3 + c for c in b"abcdefghijklmnopqrstuvwxyz"} | {2}  # letters, EOS


def test_hf_tokenizer_matcher_forces_the_choice_text(real_tokenizer_dir):
    tok = HFTokenizer.from_dir(real_tokenizer_dir("gpt-2"))
    b = LLGuidanceBackend(tok, tok.vocab_size + 47, tok.eos_token_ids)
    m = b.matcher(StructuredOutputs(choice=["hello world"]))
    out = []
    while not m.is_stopped:
        ids = allowed_ids(b, m)
        assert ids.max() < tok.vocab_size
        t = int(max(ids, key=lambda i: len(tok.decode([int(i)]))))  # the longest allowed piece
        assert m.accept(t)
        out.append(t)
    assert tok.decode(out) == "hello world"


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(regex="a("), "structured_outputs.regex: "),
        (StructuredOutputs(json={"type": "foo"}), "structured_outputs.json: Invalid type: foo"),
        (StructuredOutputs(json="{not json"), "structured_outputs.json: not valid JSON (Expecting property name"),
        (StructuredOutputs(json={"$ref": "#/nope"}), "structured_outputs.json: "),
        (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar: "),
        (StructuredOutputs(structural_tag={"structures": [], "triggers": []}), "structured_outputs.structural_tag: "),
    ],
)
def test_bad_constraints_name_the_field(spec, message):
    with pytest.raises(GrammarError) as e:
        backend().matcher(spec)
    assert str(e.value).startswith(message)


def test_hostile_constraints_are_bounded():
    with pytest.raises(GrammarError, match=r"structured_outputs.regex: 21 bytes, more than .* 20"):
        backend(max_grammar_bytes=20).matcher(StructuredOutputs(regex="[a-z]{1,5}" * 2 + "x"))
    with pytest.raises(GrammarError, match=r"structured_outputs.json: .*too big"):
        backend(initial_lexer_fuel=10).matcher(StructuredOutputs(json={"type": "string", "pattern": "^[a-z]{9}$"}))
    big = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{3,30}$"} for i in range(300)},
    }
    with pytest.raises(GrammarError, match=r"structured_outputs.json: did not compile within .* 0.001 s"):
        backend(compile_timeout_s=1e-3).matcher(StructuredOutputs(json=big))  # about 0.1 s on an idle core


def test_gbnf_and_lark_grammars():
    b = backend()
    for grammar in ('root ::= "ab" | "cd"', 'start: "ab" | "cd"'):
        m = b.matcher(StructuredOutputs(grammar=grammar))
        assert set(allowed_ids(b, m)) == {3 + ord("a"), 3 + ord("c")}


def test_structured_outputs_field_validation():
    with pytest.raises(ValueError, match=r"structured_outputs: set exactly one of .*\['json', 'regex'\]"):
        SamplingParams(structured_outputs=StructuredOutputs(json=True, regex="a")).validate()
    with pytest.raises(ValueError, match=r"structured_outputs.choice: must be a non-empty list"):
        SamplingParams(structured_outputs={"choice": []}).validate()
    with pytest.raises(ValueError, match=r"structured_outputs.jsn: unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).validate().structured_outputs.kind == "regex"


# -- the sampler never picks a refused token -----------------------------------------------------------------

ROWS = 8
_FLAGS = dict.fromkeys(("do_sample", "do_filter", "do_penalty", "want_logprobs"), True)  # one compiled variant
_sample = jax.jit(lambda logits, meta, bitmask: sample(logits, meta, bitmask, **_FLAGS))
_BACKEND = backend()
_piece = st.sampled_from(["a", "b", "xy", "[0-9]", "[a-c]+", "(ab|c)", "z?", "[0-9]{2,3}", " ", "é"])


@st.composite
def grammars(draw) -> StructuredOutputs:
    if draw(st.booleans()):
        words = st.text("abcxyz é", min_size=1, max_size=6)
        return StructuredOutputs(choice=draw(st.lists(words, min_size=1, max_size=4)))
    return StructuredOutputs(regex="".join(draw(st.lists(_piece, min_size=1, max_size=5))))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=grammars(), seed=st.integers(0, 2**31 - 1))
def test_constrained_rows_never_get_a_refused_token(spec, seed):
    """Random grammars, random logits (penalties, top-k / top-p, greedy and sampled rows): every token the
    sampler picks is one the row's matcher accepts, until the grammar completes."""
    rng = np.random.default_rng(seed)
    matchers = [_BACKEND.matcher(spec) for _ in range(ROWS)]
    meta = empty_meta(ROWS, 8, 16)
    meta["temperature"][:] = rng.choice([0.0, 0.7, 1.0, 5.0], ROWS)
    meta["top_k"][:] = rng.choice([0, 3, 50], ROWS)
    meta["top_p"][:] = rng.choice([1.0, 0.8], ROWS)
    meta["repetition_penalty"][:] = rng.choice([1.0, 1.5], ROWS)
    meta["presence_penalty"][:] = rng.choice([0.0, -2.0], ROWS)  # a negative penalty lifts scores
    meta["history"][:] = rng.integers(0, V, (ROWS, 16))
    meta["seed"][:, 0] = rng.integers(0, 2**32, ROWS)
    for step in range(12):
        live = [(m, r) for r, m in enumerate(matchers) if not m.is_stopped]
        if not live:
            break
        mask = all_allowed(ROWS, V)
        _BACKEND.fill(live, mask)
        meta["step"][:] = step
        logits = rng.normal(size=(ROWS, V)).astype(np.float32) * rng.choice([1.0, 30.0])
        out = _sample(jnp.asarray(logits), SamplingMeta(**meta), jnp.asarray(mask))
        tokens = np.asarray(out.tokens)
        allowed = np.asarray(unpack_bitmask(jnp.asarray(mask), V))
        for m, r in live:
            assert allowed[r, tokens[r]], (spec, step, r, tokens[r])
            assert m.accept(int(tokens[r])), m.error
        assert np.all(np.isfinite(np.asarray(out.logprob)))


# -- through the engine -----------------------------------------------------------------------------------


def test_regex_and_choice_hold_when_sampling_over_many_seeds(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    reqs = {}
    for seed in range(12):
        hot = SamplingParams(temperature=1.0, seed=seed, max_tokens=12)
        reqs[f"re{seed}"] = ("number: ", _with(hot, StructuredOutputs(regex=REGEX)))
        reqs[f"ch{seed}"] = ("answer: ", _with(hot, StructuredOutputs(choice=CHOICES)))
    out = run(engine, reqs)
    for rid, (c,) in out.items():
        assert c.finish_reason == "eos", (rid, c)
        if rid.startswith("re"):
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text
    assert len({c.text for rid, (c,) in out.items() if rid.startswith("re")}) > 3  # they really sample
    assert engine.structured.fill_steps > 0


def _with(params: SamplingParams, spec: StructuredOutputs) -> SamplingParams:
    from dataclasses import replace

    return replace(params, structured_outputs=spec)


def test_unconstrained_rows_get_their_solo_tokens_beside_constrained_ones(tiny_config, tiny_params):
    free = {
        "g": ([5, 9, 40, 77], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
        "s": ([7, 70, 100], SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=10, ignore_eos=True)),
        "p": ([8, 8, 8], SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=2, max_tokens=10)),
    }
    alone = run(make_engine(tiny_config, tiny_params), free)
    constrained = {
        f"c{i}": ([10 + i, 20], SamplingParams(temperature=1.0, seed=i, max_tokens=10, structured_outputs=spec))
        for i, spec in enumerate(
            [StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES), StructuredOutputs(json=True)] * 2
        )
    }
    together = run(make_engine(tiny_config, tiny_params), free | constrained)
    for rid in free:
        assert together[rid][0].token_ids == alone[rid][0].token_ids, rid


def test_lookahead_and_synchronous_steps_give_the_same_constrained_tokens(tiny_config, tiny_params):
    reqs = {
        f"r{i}": (
            [3 + i, 50],
            SamplingParams(temperature=1.0, seed=i, max_tokens=16, n=1 + i % 2, structured_outputs=spec),
        )
        for i, spec in enumerate([StructuredOutputs(regex=REGEX), StructuredOutputs(json={"type": "array"})] * 2)
    }
    sync = run(make_engine(tiny_config, tiny_params, async_scheduling=False), reqs)
    lookahead = run(make_engine(tiny_config, tiny_params), reqs)
    assert {k: [c.token_ids for c in v] for k, v in sync.items()} == {
        k: [c.token_ids for c in v] for k, v in lookahead.items()
    }
    assert all(len(v) == 1 + int(k[1:]) % 2 for k, v in sync.items())  # n=2: both samples constrained


def test_a_bad_grammar_fails_its_request_alone(tiny_config, tiny_params):
    engine = make_engine(tiny_config, tiny_params)
    engine.add_request("ok", [5, 6], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="ab")))
    with pytest.raises(ValueError, match=r"^structured_outputs.regex: "):
        engine.add_request("bad", [5, 6], SamplingParams(structured_outputs=StructuredOutputs(regex="a(")))
    assert set(engine.outputs.requests) == {"ok"}
    out = run(engine, {})
    assert out["ok"][0].text == "ab" and out["ok"][0].finish_reason == "eos"


def test_a_refused_token_ends_the_sequence_with_a_clear_reason(tiny_config, tiny_params):
    """What the engine does when a matcher fails mid-request (a resource limit): the real matcher and the
    engine's own handler, fed a token the grammar refuses."""
    engine = make_engine(tiny_config, tiny_params)
    engine.add_request("r", [5], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[0-9]+")))
    req = engine.outputs.requests["r"]
    seq = req.seqs[0]
    assert engine._advance(seq, req.matcher(seq), 3 + ord("x")) is FinishReason.ERROR
    assert seq.stop_reason.startswith("structured output: ") and "doesn't satisfy the grammar" in seq.stop_reason
    engine.abort("r")


def test_no_recompilation_with_constrained_rows(tiny_config, tiny_params):
    """After warming up the shapes its requests need, a mixed constrained / unconstrained workload (lookahead
    steps with deferred sampling among them) compiles nothing."""
    engine = make_engine(tiny_config, tiny_params)
    rng = np.random.default_rng(3)
    specs = [None, StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES), StructuredOutputs(json=True)]
    reqs = {
        f"w{i}": (
            rng.integers(3, 259, int(rng.integers(1, 40))).tolist(),
            SamplingParams(
                temperature=float(rng.choice([0.0, 1.0])),
                max_tokens=int(rng.integers(1, 12)),
                logprobs=int(rng.choice([0, 2])) or None,
                structured_outputs=specs[i % 4],
            ),
        )
        for i in range(16)
    }
    plan = plan_for_requests(((len(p), sp) for p, sp in reqs.values()), 64)
    engine.warmup(plan, progress=False)
    compiled = engine.runner.compile_stats.count
    run(engine, reqs)
    assert engine.structured.fill_steps > 0
    assert engine.runner.compile_stats.count == compiled
    assert engine.stats().compiles_after_warmup == 0


def test_batch_lines_take_structured_outputs():
    from paged_jax.offline.lines import parse_line

    item = parse_line('{"prompt": "x", "structured_outputs": {"json": {"type": "array"}}}', 1)
    assert item.params.structured_outputs == StructuredOutputs(json={"type": "array"})
    with pytest.raises(ValueError, match=r"^structured_outputs.jsn: unknown field"):
        parse_line('{"prompt": "x", "structured_outputs": {"jsn": {}}}', 2)

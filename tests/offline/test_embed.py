"""`LLM.embed` against transformers: the final hidden states (after the final norm) of a small random
Qwen3-Embedding-shaped model (tests/data/hf_qwen3_embed, made by scripts/golden/make_hf_golden.py), pooled
last-token and mean, normalized or not, truncated (Matryoshka) and renormalized, float32 within 1e-4; prompts
split into chunks, several in one step, and served again from the prefix cache give the same vectors; every page
comes back."""

from __future__ import annotations

import numpy as np
import pytest

from paged_jax.engine.input_processor import GenerationRequest
from paged_jax.engine.load import load_model
from paged_jax.errors import FieldError
from paged_jax.offline.llm import LLM
from paged_jax.pooling_params import PoolingParams
from paged_jax.sampling_params import SamplingParams

from support.engines import make_engine
from support.hf_golden import DATA

ATOL = 1e-4
MODEL = DATA / "hf_qwen3_embed"


@pytest.fixture(scope="module")
def llm():
    # chunk_size 8: the 11- and 23-token prompts are pooled over several steps; all three share steps
    return LLM(str(MODEL), dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, chunk_size=8, warmup=False)


@pytest.fixture(scope="module")
def golden():
    data = np.load(MODEL / "golden.npz")
    return [(data[f"prompt_{i}"], data[f"hidden_{i}"]) for i in range(3)]


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _embed(llm, golden, **kw) -> list[np.ndarray]:
    outs = llm.embed([p.tolist() for p, _ in golden], use_tqdm=False, **kw)
    assert all(o.finished and o.outputs[0].token_ids == [] for o in outs)
    return [np.asarray(o.embedding, np.float32) for o in outs]


def test_model_pooler_is_read_from_its_files(llm):
    pooler = llm.engine.engine_config.pooler
    assert (pooler.pooling, pooler.normalize, pooler.matryoshka) == ("last", True, True)


def test_last_token_normalized_matches_transformers(llm, golden):
    got = _embed(llm, golden)  # the model's own pooling: last token, normalized
    for v, (_, hidden) in zip(got, golden, strict=True):
        np.testing.assert_allclose(v, _unit(hidden[-1]), atol=ATOL)
    llm.engine.check_invariants()
    kv = llm.engine.kv.stats()
    assert kv.pages_in_use == 0, kv  # every page back (prefix-cached ones only in the free list)


def test_mean_and_unnormalized_match_transformers(llm, golden):
    for v, (_, hidden) in zip(_embed(llm, golden, pooling="mean"), golden, strict=True):
        np.testing.assert_allclose(v, _unit(hidden.mean(0)), atol=ATOL)
    for v, (_, hidden) in zip(_embed(llm, golden, pooling="mean", normalize=False), golden, strict=True):
        np.testing.assert_allclose(v, hidden.mean(0), atol=ATOL)
    for v, (_, hidden) in zip(_embed(llm, golden, normalize=False), golden, strict=True):
        np.testing.assert_allclose(v, hidden[-1], atol=ATOL)


def test_matryoshka_truncates_then_renormalizes(llm, golden):
    for v, (_, hidden) in zip(_embed(llm, golden, dimensions=8), golden, strict=True):
        assert v.shape == (8,)
        np.testing.assert_allclose(v, _unit(hidden[-1][:8]), atol=ATOL)


def test_prefix_cached_prompt_gives_the_same_vector(llm, golden):
    prompt = golden[2][0].tolist()
    cold = llm.embed([prompt], use_tqdm=False)[0]
    warm = llm.embed([prompt], use_tqdm=False)[0]  # its full blocks from the cache, the last token recomputed
    assert warm.metrics.num_cached_prompt_tokens > 0
    np.testing.assert_allclose(warm.embedding, cold.embedding, atol=1e-6)
    mean = [np.asarray(llm.embed([prompt], pooling="mean", use_tqdm=False)[0].embedding) for _ in range(2)]
    np.testing.assert_allclose(mean[1], mean[0], atol=1e-6)  # mean pooling reads no cache: every position pooled


def test_bad_input_names_the_field(llm):
    with pytest.raises(FieldError, match="^dimensions: "):
        llm.embed("hi", dimensions=33)
    with pytest.raises(FieldError, match="^pooling: "):
        llm.embed("hi", pooling="cls")
    with pytest.raises(FieldError, match="^prompt: "):
        llm.embed("")
    with pytest.raises(FieldError, match="^prompt_token_ids: "):
        llm.embed([[1] * 300])  # longer than max_model_len (256)
    assert not llm.engine.has_unfinished()


def test_engine_without_lookahead_and_beside_generation(golden):
    """The engine API, one step at a time (no lookahead), an embedding sharing steps with a generating request:
    the same vectors, no sample for the embedding, the generation unaffected."""
    config, params, tokenizer = load_model(MODEL, dtype="float32")
    engine = make_engine(config, params, tokenizer, async_scheduling=False, max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("alone", golden[0][0].tolist(), greedy)
    alone = _drain(engine)["alone"]
    engine.add_request("gen", golden[0][0].tolist(), greedy)
    for i, (prompt, _) in enumerate(golden):
        pooled = GenerationRequest(prompt.tolist(), pooling=PoolingParams("mean"))
        engine.add_request(f"e{i}", engine.inputs.process(pooled))
    outs = _drain(engine)
    assert outs["gen"].outputs[0].token_ids == alone.outputs[0].token_ids
    for i, (_, hidden) in enumerate(golden):
        assert outs[f"e{i}"].outputs[0].token_ids == [] and outs[f"e{i}"].metrics.num_generated_tokens == 0
        np.testing.assert_allclose(outs[f"e{i}"].embedding, _unit(hidden.mean(0)), atol=ATOL)
    assert engine.kv.stats().pages_in_use == 0
    engine.check_invariants()


def _drain(engine) -> dict:
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals

"""A model whose every layer slides by one window (Mistral-7B-v0.1's shape: `model_type` mistral, `sliding_window`
set, no `use_sliding_window`), scaled down to the tiny GQA checkpoint's weights with a window of 12 over pages of
8: one KV cache group whose tables drop the pages the window left behind. Greedy tokens on prompts four and five
windows long, prefilled in chunks of 8 that cross window and page edges, equal those of full-length pages
(`hybrid_kv=False`) and of the dense reference; the held pages stay within the window's reach, the invariants hold
after every step and every page is free at the end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from paged_jax.engine.load import load_model
from paged_jax.kv_cache.page_bounds import cdiv
from paged_jax.model.families import causal_lm
from paged_jax.model.reference import greedy_generate
from paged_jax.model.scan import stack_layers
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams

DATA = Path(__file__).parents[1] / "data"
WINDOW, PAGE, CHUNK = 12, 8, 8
# Mistral-7B-v0.1's config.json, its sizes those of tests/data/hf_gqa (whose weights a Mistral layer reads alike).
CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "model_type": "mistral",
    "num_attention_heads": 8,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": WINDOW,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 320,
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf_mistral")
    shutil.copy(DATA / "hf_gqa" / "model.safetensors", directory)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory


def make_llm(directory: Path, **options) -> LLM:
    kwargs = dict(
        dtype="float32",
        attention_backend="xla",
        page_size=PAGE,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        chunk_size=CHUNK,
        warmup=False,
        scan_layers="on",
    )
    return LLM(str(directory), **(kwargs | options))


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Every request to the end, the invariants checked after each step: each one's tokens, and the most live
    (not dropped) pages one request held after a step."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        engine.check_invariants()
        for rid in engine.kv.requests:
            peak = max(peak, sum(p != 0 for p in engine.kv.page_ids(rid)))
    st = engine.kv.stats()
    assert st.pages_in_use == 0 and st.pages_free == st.pages_total  # every page back
    return [done[f"r{i}"] for i in range(len(prompts))], peak


def test_uniform_window_equals_full_length_pages_and_the_dense_reference(mistral: Path) -> None:
    config, params, _ = load_model(mistral, dtype="float32")
    assert [config.layer_sliding_window(i) for i in range(config.num_layers)] == [WINDOW] * config.num_layers
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (4 * WINDOW, 5 * WINDOW + 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    windowed = make_llm(mistral)
    assert windowed.engine.kv.num_groups == 1 and windowed.engine.kv.windows == (WINDOW,)
    got, peak = run(windowed, prompts, greedy)
    full = make_llm(mistral, hybrid_kv=False)
    assert full.engine.kv.num_groups == 1 and full.engine.kv.windows == ()
    want_full, peak_full = run(full, prompts, greedy)

    model, stacked = causal_lm(config, scan_layers=True), stack_layers(params)
    reference = [greedy_generate(model, stacked, p, 12, pad_to=128) for p in prompts]
    assert got == want_full == reference
    # The window group holds what one step's queries read; full-length pages hold every block.
    assert peak <= cdiv(WINDOW - 1 + CHUNK, PAGE) + 1 < cdiv(len(prompts[1]), PAGE) <= peak_full

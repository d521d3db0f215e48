"""A model directory as people ship it (weights, Phi-3's tokenizer and chat template, generation_config.json)
through LLM.generate / LLM.chat, the batch script and `paged-jax info`; every EOS ends generation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged_jax.config.engine import EngineConfig
from paged_jax.config.generation_defaults import load_generation_defaults
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.offline.batch import run_batch
from paged_jax.offline.lines import parse_line
from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import template_from_text
from paged_jax.tokenization.tokenizer import ByteTokenizer
from serve.main import main

DATA = Path(__file__).parents[1] / "data"
GOLDEN = json.loads((DATA / "tokenizers" / "golden.json").read_text("utf-8"))["tokenizers"]["phi-3"]
PHI3_VOCAB = 32064
GENERATION_CONFIG = {
    "eos_token_id": [32000, 32007],
    "temperature": 0.6,
    "top_p": 0.9,
    "max_new_tokens": 7,
    "do_sample": True,
}
OPTIONS = dict(num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, attention_backend="xla", warmup=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, real_tokenizer_dir) -> Path:
    """The small GQA golden model with its embeddings grown to Phi-3's vocabulary, plus Phi-3's tokenizer files."""
    out = tmp_path_factory.mktemp("phi3-model")
    tensors = load_file(str(DATA / "hf_gqa" / "model.safetensors"))
    rng = np.random.default_rng(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = rng.normal(0, 0.5, (PHI3_VOCAB, tensors[name].shape[1])).astype(np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((DATA / "hf_gqa" / "config.json").read_text())
    config.update(vocab_size=PHI3_VOCAB, bos_token_id=1, eos_token_id=32000)
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    for path in real_tokenizer_dir("phi-3").iterdir():
        shutil.copy(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(str(model_dir), **OPTIONS)


def test_text_prompts_are_tokenized_like_transformers(llm):
    texts = ["Hello world", " leading space", "日本語 🙂"]
    from tests.tokenization.test_tokenizer import (
        vectors,  # the llama.cpp strings, with transformers' ids (BOS from the post-processor)
    )

    strings = [text for text, _ in vectors("phi-3")]
    outs = llm.generate(texts + [strings[0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    for text, out in zip(texts, outs, strict=False):
        assert out.prompt_token_ids == [1] + llm.tokenizer.encode(text, add_special_tokens=False)
    assert outs[-1].prompt_token_ids == GOLDEN["encode_with_special_tokens"][0]


def test_chat_renders_the_models_template(llm):
    case = next(c for c in GOLDEN["chat"] if c["template"] is None and c["add_generation_prompt"])
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    [out] = llm.chat(case["messages"], greedy, use_tqdm=False)
    assert out.prompt_token_ids == case["ids"]
    [same] = llm.generate({"prompt_token_ids": case["ids"]}, greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    several = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    outs = llm.chat(several, greedy, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        llm.tokenizer.encode(f"<s><|user|>\nQuestion {i}?<|end|>\n<|assistant|>\n", add_special_tokens=False)
        for i in range(3)
    ]
    with pytest.raises(ValueError, match=r"^messages\[1\]\[0\].role: "):
        llm.chat([several[0], [{"role": "bot", "content": "x"}]], greedy, use_tqdm=False)
    [own] = llm.chat(several[0], greedy, use_tqdm=False, chat_template="{{ messages[0].content }}")
    assert own.prompt_token_ids == llm.tokenizer.encode("Question 0?", add_special_tokens=False)


def test_generation_config_supplies_eos_and_sampling_defaults(llm, model_dir):
    assert llm.engine.config.eos_token_ids == (32000, 32007)
    assert load_generation_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert load_generation_defaults(model_dir, "none") == {}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.6, 0.9, 7)
    [out] = llm.generate("Hi", use_tqdm=False)  # no SamplingParams: the model's defaults
    assert len(out.outputs[0].token_ids) <= 7
    item = parse_line('{"prompt": "x", "top_p": 0.5}', 1, defaults=llm.engine.engine_config.sampling_defaults)
    assert (item.params.temperature, item.params.top_p, item.params.max_tokens) == (0.6, 0.5, 7)


def test_bad_generation_config_names_the_field(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="^generation_config.json: top_p: "):
        load_generation_defaults(tmp_path)


def test_batch_lines_with_messages(llm, tmp_path):
    lines = [
        {"id": "chat", "messages": [{"role": "user", "content": "Hello, who are you?"}], "temperature": 0.0},
        {"id": "text", "prompt": "Hello", "max_tokens": 2},
        {"id": "bad-role", "messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
        {"id": "bad-shape", "messages": "hello"},
        {"id": "tools-without-chat", "prompt": "x", "tools": []},
        {"id": "refused", "messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": []},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(llm.engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert set(out) == {"chat", "text"} and summary.errors == 4
    case = next(c for c in GOLDEN["chat"] if c["template"] is None and c["add_generation_prompt"])
    assert out["chat"]["usage"]["prompt_tokens"] == len(case["ids"])
    assert out["chat"]["usage"]["completion_tokens"] <= 7  # max_new_tokens of generation_config.json
    assert [(e["line"], e["error"].split(":")[0]) for e in errors] == [
        (3, "messages[1].role"),
        (4, "messages"),
        (5, "tools"),
        (6, "chat_template_kwargs"),
    ]


def test_batch_chat_without_a_template_is_an_error_line(tiny_config, tiny_params, tmp_path):
    engine = LLMEngine(tiny_config, tiny_params, ByteTokenizer(), EngineConfig(**OPTIONS))
    lines = [
        {"id": "a", "prompt": "hi", "max_tokens": 2},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"id": "c", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": 1}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    errors = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert summary.requests == 1 and [(e["line"], e["id"]) for e in errors] == [(2, "b"), (3, "c")]
    assert errors[0]["error"].startswith("messages: the model has no chat template; give one with --chat-template")
    engine.tokenizer.chat_template = template_from_text("{{ messages[0].content }}")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out2.jsonl", progress=False)
    errors = [json.loads(line) for line in (tmp_path / "out2.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["error"].split(":")[0]) for e in errors] == [(3, "chat_template_kwargs")]


def test_info_prints_what_the_model_files_say(model_dir, capsys):
    assert main(["info", "--model", str(model_dir)]) == 0
    text = capsys.readouterr().out
    assert "post-processor adds BOS" in text and "vocab 32064" in text
    assert "bos='<s>' 1 (tokenizer_config.json)" in text and "eos='<|endoftext|>' 32000 (tokenizer_config.json)" in text
    assert "eos set (ends generation): [32000, 32007]" in text
    assert "chat template: chat_template.jinja (default)" in text
    assert "generation defaults: temperature=0.6, top_p=0.9, max_tokens=7" in text
    assert main(["info", "--model", "tiny", "--generation-config", "none"]) == 0
    text = capsys.readouterr().out
    assert "chat template: none (give one with --chat-template FILE)" in text and "generation defaults: none" in text


def test_every_eos_of_the_tokenizer_ends_generation(tiny_config, tiny_params):
    """The engine stops at any id of the tokenizer's EOS set, not only the model config's."""
    # A stop id that first appears after the first generated token (the random model may repeat a token).
    for prompt in ([1, 50, 60, 70, 80], [1, 90, 100, 110], [1, 7, 200, 33, 41, 19]):
        engine = LLMEngine(tiny_config, tiny_params, ByteTokenizer(), EngineConfig(**OPTIONS))
        engine.add_request("free", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            outs = engine.step()
        free = outs[-1].outputs[0].token_ids
        firsts = [i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != 2]
        if firsts:
            break
    else:
        pytest.fail("the tiny model repeats one token for every prompt tried")
    i = firsts[0]
    engine = LLMEngine(tiny_config, tiny_params, ByteTokenizer(eos_token_ids=(2, free[i])), EngineConfig(**OPTIONS))
    assert engine.config.eos_token_ids == (2, free[i])
    engine.add_request("eos", prompt, SamplingParams(temperature=0.0, max_tokens=6))
    while engine.has_unfinished():
        outs = engine.step()
    done = outs[-1].outputs[0]
    assert done.token_ids == free[: i + 1] and done.finish_reason == "eos"

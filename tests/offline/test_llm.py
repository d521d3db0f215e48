"""The offline `LLM` API: what one call leaves behind when a prompt is invalid."""

from __future__ import annotations

import pytest

from paged_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_pages=64, max_num_seqs=8, max_num_batched_tokens=64, attention_backend="xla", warmup=False)


def test_an_invalid_prompt_withdraws_the_whole_call(llm):
    """Issue 14.13: prompts before an invalid one stayed queued, and the next call raised KeyError on their
    outputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="^prompt_token_ids:"):
        llm.generate(["hello", "world", {"prompt_token_ids": [10**6]}], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    outs = llm.generate(["hello"], greedy, use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    assert llm.stats().pages_in_use == 0


def test_n_above_max_num_seqs_is_refused(llm):
    """Issue 14.2, through the offline API."""
    with pytest.raises(ValueError, match=r"^n: must be in \[1, 8\]"):
        llm.generate("hello", SamplingParams(n=9), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_detokenize_false_returns_the_same_ids_without_text(llm):
    """vLLM's `detokenize=False`: token ids only (no per-token detokenization on the host); stop strings, which
    are matched on the text, are refused with it."""
    prompts = ["hello", "the quick brown fox"]
    with_text = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids_only = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False), use_tqdm=False
    )
    for a, b in zip(with_text, ids_only, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(a.outputs[0].token_ids) == 6
        assert b.outputs[0].text == ""
        assert a.outputs[0].text == llm.engine.outputs.tokenizer.decode(a.outputs[0].token_ids)
    with pytest.raises(ValueError, match="^detokenize:"):
        llm.generate("hello", SamplingParams(stop=["x"], detokenize=False), use_tqdm=False)
    with pytest.raises(ValueError, match="^detokenize: must be a boolean"):
        llm.generate("hello", SamplingParams(detokenize=1), use_tqdm=False)
    assert llm.stats().pages_in_use == 0


THINKING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
)  # Qwen3.5's generation prompt: the thought is open when the reply starts


def test_chat_returns_the_thought_apart_from_the_answer(llm):
    """On a thinking template `LLM.chat` splits each reply as the servers do: the thought (within the budget) in
    `reasoning_content`, the answer alone in `text`, every token in `token_ids`; elsewhere `reasoning_content`
    stays None and `text` whole."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, max_reasoning_tokens=4)
    ask = [{"role": "user", "content": "Hi"}]
    c = llm.chat(ask, params, use_tqdm=False, chat_template=THINKING)[0].outputs[0]
    whole = llm.engine.tokenizer.decode(c.token_ids, skip_special_tokens=False)
    thought, answer = whole.split("</think>", 1)
    assert (c.reasoning_content, c.text) == (thought, answer) and len(c.token_ids) == 12
    plain = llm.chat(ask, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False, chat_template="{{ 'x' }}")
    assert plain[0].outputs[0].reasoning_content is None and plain[0].outputs[0].text

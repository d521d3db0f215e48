"""Qwen3.5's thinking switch through the template sandbox: `chat_template_kwargs={"enable_thinking": ...}` renders
the generation prompt that opens the thought (on, the default) or writes an empty closed one (off), the reasoning
parser reads where the reply starts from that prompt, and a reply's `<think>` output splits into reasoning and
answer; then the same through `LLM.chat` on the tiny Qwen3.5 hybrid (tests/data/hf_qwen3_5).

The real Qwen3.5 template is not available offline (none in tests/data, /work/shared/tokenizers, the HF cache or
transformers' fixtures), and the repo ships none for the family, so `QWEN3_5` is the part of its published format
the switch and the parser depend on: ChatML turns, earlier assistant turns without their thought, and the
generation prompt `<|im_start|>assistant\\n<think>\\n` (thinking) or `...<think>\\n\\n</think>\\n\\n` (not).
"""

from __future__ import annotations

import pytest

from paged_jax.offline.llm import LLM
from paged_jax.sampling_params import SamplingParams
from paged_jax.tokenization.chat_template import apply_chat_template, template_from_text
from paged_jax.tokenization.reasoning import Thought, reasoning_format, split_reasoning
from paged_jax.tokenization.tokenizer import ByteTokenizer

from support.hf_golden import DATA

QWEN3_5 = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{%- set content = m.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
CHAT = [
    {"role": "user", "content": "1+1?"},
    {"role": "assistant", "content": "<think>\nOne and one.\n</think>\n\n2"},
    {"role": "user", "content": "2+2?"},
]
HISTORY = "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
PROMPTS = {  # enable_thinking -> the rendered generation prompt after the history
    None: "<|im_start|>assistant\n<think>\n",  # not given: Qwen3.5 thinks by default
    True: "<|im_start|>assistant\n<think>\n",
    False: "<|im_start|>assistant\n<think>\n\n</think>\n\n",
}
TOK = ByteTokenizer()


@pytest.mark.parametrize("thinking", [None, True, False])
def test_the_switch_renders_the_prompt_and_the_parser_reads_it(thinking):
    template = template_from_text(QWEN3_5)
    fmt = reasoning_format(template)
    assert fmt is not None and fmt.name == "qwen3"  # the family's <think> format, found in the template
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    text, ids = apply_chat_template(TOK, CHAT, chat_template=template, template_kwargs=kwargs)
    assert text == HISTORY + PROMPTS[thinking]  # the earlier turn's thought is not in the history
    thought = Thought.of(fmt, TOK, ids)
    if thinking is False:
        assert thought.state == "answer"  # the prompt closed an empty thought: the reply is all answer
        assert split_reasoning(fmt, thought.state, "4") == (None, "4")
        assert split_reasoning(fmt, thought.state, "<think>x</think>4") == (None, "<think>x</think>4")
    else:
        assert thought.state == "thinking"  # the prompt opened the thought: the reply starts inside it
        assert split_reasoning(fmt, thought.state, "Two and two.\n</think>\n\n4") == ("Two and two.\n", "\n\n4")
        assert split_reasoning(fmt, thought.state, "cut off") == ("cut off", None)  # never closed: all thought


def test_llm_chat_on_the_hybrid_switches_thinking():
    """`LLM.chat` on the tiny Qwen3.5 hybrid with the template: the prompt the engine ran is the rendered one, and
    the (random-weight) reply is all thought with thinking on (never closed) and all answer with it off. About 12 s
    on the loaded 2-core CPU: the engine's first prefill and decode compiles (one engine, one sequence)."""
    llm = LLM(
        str(DATA / "hf_qwen3_5"),
        dtype="float32",
        num_pages=32,
        max_num_seqs=1,
        enable_prefix_caching=False,
        warmup=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokenizer = llm.engine.tokenizer
    for thinking in (True, False):
        kwargs = {"enable_thinking": thinking}
        (out,) = llm.chat(CHAT, params, use_tqdm=False, chat_template=QWEN3_5, chat_template_kwargs=kwargs)
        assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == HISTORY + PROMPTS[thinking]
        (reply,) = out.outputs
        whole = tokenizer.decode(reply.token_ids, skip_special_tokens=False)
        assert len(reply.token_ids) == 4 and "</think>" not in whole
        if thinking:
            assert (reply.reasoning_content, reply.text) == (whole, "")
        else:
            assert not reply.reasoning_content and reply.text == whole
    assert llm.engine.stats().state_slots_in_use == 0

"""What transformers gives for the real vocabularies under tests/data/tokenizers/: tests/data/tokenizers/golden.json.

Run by hand with transformers and jinja2 installed (not in CI; no torch needed):
    python scripts/golden/make_tokenizer_golden.py

For each tokenizer (`AutoTokenizer.from_pretrained` on the directory): the ids of every llama.cpp test string
with special tokens (`tokenizer(text)["input_ids"]`), `decode` of a few id lists with and without special
tokens, and `apply_chat_template` of a few conversations: with the model's own template (Phi-3) and with the
templates in `TEMPLATES` (a ChatML template with tools, a Llama-3-style one), rendered text and ids.
"""

from __future__ import annotations

import json
import lzma
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "tokenizers"

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "Et 3 × 3 ? 日本語もどうぞ 🙂"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

# Written for these tests in the style of popular models' templates: loop controls, tojson with non-ASCII,
# namespaces, tools, raise_exception and a generation prompt.
TEMPLATES = {
    "chatml_tools": (
        "{%- if tools %}<|im_start|>system\n"
        "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
        "You may call these tools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n"
        "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' %}{% continue %}{% endif %}"
        "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
    ),
    "llama3_style": (
        "{{- bos_token }}{%- set ns = namespace(turns=0) %}"
        "{%- for message in messages %}"
        "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{- raise_exception('Unknown role: ' + message['role']) }}{%- endif %}"
        "{%- set ns.turns = ns.turns + 1 %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
    ),
}
DECODE_IDS = {
    "phi-3": [
        [1, 32010, 29871, 13, 10994, 32007, 32001, 29871, 7251],
        [32001, 450, 4799, 338, 7254, 29889, 32007],
        [29871, 233, 154, 168, 30325, 232, 154],
    ],
    "gpt-2": [[15496, 50256, 50256, 23105], [464, 6766, 318, 4171, 13, 50256], [13783, 98, 17312, 105]],
}


def _ids(result) -> list[int]:
    return list(result["input_ids"] if hasattr(result, "keys") else result)


def main() -> None:
    out: dict = {"transformers": transformers.__version__, "tokenizers": {}}
    for name in ("phi-3", "gpt-2"):
        src = DATA / name
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            (tmp / "tokenizer.json").write_bytes(lzma.decompress((src / "tokenizer.json.xz").read_bytes()))
            for path in src.iterdir():
                if path.suffix in (".json", ".jinja"):
                    (tmp / path.name).write_bytes(path.read_bytes())
            tok = AutoTokenizer.from_pretrained(tmp)
            texts = (src / "vectors.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
            entry: dict = {
                "class": type(tok).__name__,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "encode_with_special_tokens": [tok(text)["input_ids"] for text in texts],
                "decode": [
                    {
                        "ids": ids,
                        "skip": tok.decode(ids, skip_special_tokens=True),
                        "keep": tok.decode(ids, skip_special_tokens=False),
                    }
                    for ids in DECODE_IDS[name]
                ],
                "chat": [],
            }
            own = [(None, None)] if tok.chat_template else []
            for template_name, template in own + list(TEMPLATES.items()):
                for conversation in CONVERSATIONS:
                    for add_generation_prompt in (True, False):
                        for tools in (None, TOOLS) if template_name == "chatml_tools" else (None,):
                            kwargs = dict(
                                add_generation_prompt=add_generation_prompt, tools=tools, chat_template=template
                            )
                            text = tok.apply_chat_template(conversation, tokenize=False, **kwargs)
                            ids = _ids(tok.apply_chat_template(conversation, tokenize=True, **kwargs))
                            entry["chat"].append(
                                {
                                    "template": template_name,
                                    "messages": conversation,
                                    "add_generation_prompt": add_generation_prompt,
                                    "tools": tools,
                                    "text": text,
                                    "ids": ids,
                                }
                            )
            out["tokenizers"][name] = entry
    out["templates"] = TEMPLATES
    (DATA / "golden.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {DATA / 'golden.json'} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()

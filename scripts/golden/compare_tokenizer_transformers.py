"""Compare paged-jax's tokenizer with transformers' on many random inputs (a manual check, not CI).

Two steps, because transformers and the project live in different environments:

    python scripts/golden/compare_tokenizer_transformers.py dump /tmp/tok.json          # with transformers installed
    .venv/bin/python scripts/golden/compare_tokenizer_transformers.py check /tmp/tok.json

`dump` writes, for the real vocabularies under tests/data/tokenizers/, transformers' ids of random texts
(`tokenizer(text)`: special tokens added by the post-processor) and its `decode` of random id lists with and
without special tokens; `check` loads the same directories with
`paged_jax.tokenization.tokenizer.load_tokenizer` and prints the mismatch counts.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "tokenizers"
NAMES = ("phi-3", "gpt-2")


def model_dir(name: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"tok-{name}-"))
    (out / "tokenizer.json").write_bytes(lzma.decompress((DATA / name / "tokenizer.json.xz").read_bytes()))
    for path in (DATA / name).iterdir():
        if path.suffix in (".json", ".jinja"):
            (out / path.name).write_bytes(path.read_bytes())
    return out


def dump(path: Path, count: int, seed: int) -> None:
    from transformers import AutoTokenizer

    rng = random.Random(seed)
    out = {}
    for name in NAMES:
        tok = AutoTokenizer.from_pretrained(model_dir(name))
        texts = (DATA / name / "vectors.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
        pool = texts + ["<|endoftext|>", "<s>", "</s>", "<|user|>", " 日本語", "🙂", "\t\n", "  x"]
        random_texts = ["".join(rng.choice(pool) for _ in range(rng.randint(1, 6))) for _ in range(count)]
        vocab, added = len(tok), list(tok.added_tokens_decoder)
        streams = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] + rng.choices(added, k=rng.randint(0, 2))
            for _ in range(count)
        ]
        out[name] = {
            "encode": [[t, tok(t)["input_ids"]] for t in texts + random_texts],
            "decode": [
                [ids, tok.decode(ids, skip_special_tokens=True), tok.decode(ids, skip_special_tokens=False)]
                for ids in streams
            ],
        }
    path.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")
    print(f"wrote {path}")


def check(path: Path) -> int:
    from paged_jax.config import load_model_config
    from paged_jax.tokenization.tokenizer import load_tokenizer

    expected = json.loads(path.read_text(encoding="utf-8"))
    bad_total = 0
    for name in NAMES:
        tok = load_tokenizer(model_dir(name), load_model_config("tiny"))
        cases = expected[name]
        enc = sum(tok.encode(text) != ids for text, ids in cases["encode"])
        dec = sum(
            (tok.decode(ids) != skip) + (tok.decode(ids, skip_special_tokens=False) != keep)
            for ids, skip, keep in cases["decode"]
        )
        print(
            f"{name}: encode with special tokens {enc}/{len(cases['encode'])} mismatches; "
            f"decode {dec}/{2 * len(cases['decode'])} mismatches (skipping and keeping special tokens)"
        )
        bad_total += enc + dec
    return 1 if bad_total else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("dump", "check"))
    parser.add_argument("file", type=Path)
    parser.add_argument("--count", type=int, default=2000, help="random texts and id lists per vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.step == "dump":
        dump(args.file, args.count, args.seed)
        return 0
    return check(args.file)


if __name__ == "__main__":
    raise SystemExit(main())

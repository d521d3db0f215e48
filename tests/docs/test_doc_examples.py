"""The README's and the docs' examples stay true to the code: every `paged-jax ...` command in a shell block parses
with the real parser (no unknown or misspelt flag, no port clash a `serve` would refuse), every Python block
compiles and imports only modules that exist under the names an installed wheel has (`paged_jax.serve.client`,
never the checkout-only top-level `serve`), and every Python block runs: the offline ones (`LLM`) in this
process, the client ones (`openai`, the gRPC `Client`) against a real `paged-jax serve` process.

The examples name real models and vLLM's ports; the runs use a small HF-format model the test builds
(tests/data/hf_gqa's weights, its byte tokenizer and a chat template, 256 positions) and the server's actual
ports. Those are the only changes made to an example's text (`offline_substitutions` and the ports): a block
that fails here fails as the user would see it, with its page and line."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tokenizers
from grpc_health.v1 import health_pb2

from serve.cli import model_arg
from serve.client import Client
from serve.main import parse_args
from serve.ports import resolve_ports

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(kinds: tuple[str, ...]) -> list[tuple[str, str]]:
    """(page:line, code) of each fenced block of one of `kinds`."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group(1) in kinds:
                found.append((f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}", m.group(2)))
    return found


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `paged-jax`) of each command line in a shell block (continuation lines joined)."""
    found = []
    for where, code in blocks(("bash", "sh", "shell")):
        for line in code.replace("\\\n", " ").splitlines():
            if "paged-jax " not in line:
                continue
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                if word.endswith("paged-jax") and i + 1 < len(words):
                    found.append((where, words[i + 1 :]))
                    break
    return found


COMMANDS = commands()


def test_the_pages_have_commands_and_python():
    assert len(COMMANDS) >= 10 and len(blocks(("python",))) >= 10


@pytest.mark.parametrize("where, argv", COMMANDS, ids=[f"{w}:{a[0]}" for w, a in COMMANDS])
def test_each_command_parses(where, argv, capsys):
    try:
        args, _ = parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: paged-jax {shlex.join(argv)}: {capsys.readouterr().err.strip()}")
    if args.command == "serve":
        model_arg(args)
        resolve_ports(args)


@pytest.mark.parametrize("where, code", blocks(("python",)), ids=lambda v: v if ":" in v else "")
def test_each_python_block_compiles_and_imports_what_exists(where, code):
    tree = compile(code, where, "exec", ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert name.split(".")[0] != "serve", f"{where}: `{name}` is `paged_jax.{name}` once installed"
            assert importlib.util.find_spec(name) is not None, f"{where}: no module {name}"


HF_GQA = ROOT / "tests" / "data" / "hf_gqa"
# A Hermes-family template (tool calls as <tool_call>{...}</tool_call>), so the tool-call example has a parser.
TEMPLATE = (
    "{% if tools %}<tools>call one as <tool_call>{json}</tool_call></tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)
MODEL_NAMES = (
    '"smollm2-135m-instruct"',
    '"path/to/hf-llama-dir"',
    '"google/gemma-3-4b-it"',
    '"Qwen/Qwen3-Embedding-0.6B"',
)
SERVER_MARKERS = ("OpenAI(", "Client(")  # a block that talks to a running server


def is_server_block(code: str) -> bool:
    return any(m in code for m in SERVER_MARKERS)


PYTHON = blocks(("python",))
OFFLINE = [(w, c) for w, c in PYTHON if not is_server_block(c)]
ONLINE = [(w, c) for w, c in PYTHON if is_server_block(c)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """An HF directory the examples' models are replaced by: 2 layers, 256 positions, a chat template, and a
    sentence-transformers last-token pooling (it serves the embedding examples too)."""
    d = tmp_path_factory.mktemp("example-model")
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(HF_GQA / f, d / f)
    pooling = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (d / "modules.json").write_text(json.dumps(pooling))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    # A byte-level BPE within the model's 320 ids, trained on this file (deterministic, offline): a tokenizer.json
    # is what makes the directory's chat template the tokenizer's (a directory without one gets byte ids only).
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(Path(__file__).read_text().splitlines(), trainer)
    tokenizer.save(str(d / "tokenizer.json"))
    return d


def offline_substitutions(code: str, model: Path) -> str:
    for name in MODEL_NAMES:
        code = code.replace(name, repr(str(model)))
    return re.sub(r"max_model_len=\d+", "max_model_len=256", code)


def run_block(where: str, code: str, namespace: dict) -> None:
    try:
        exec(compile(code, where, "exec"), namespace)
    except Exception as e:  # noqa: BLE001 - reported with the block's page and line
        pytest.fail(f"{where}: the example fails: {type(e).__name__}: {e}\n{code}")


def test_the_examples_split_into_offline_and_server_blocks():
    assert len(OFFLINE) >= 4 and len(ONLINE) >= 5


@pytest.mark.slow  # compiles the examples' step shapes
def test_each_offline_example_runs(model_dir, capsys):
    from paged_jax import LLM, SamplingParams

    shared = LLM(str(model_dir))  # for a block that uses `llm` as given (the pages before it made one)
    for where, code in OFFLINE:
        run_block(
            where, offline_substitutions(code, model_dir), {"LLM": LLM, "SamplingParams": SamplingParams, "llm": shared}
        )
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.slow  # a real server process
def test_each_server_example_runs_against_paged_jax_serve(model_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    for name in ("PAGED_JAX_API_KEY", "PAGED_JAX_AUTH_TOKEN", "VLLM_API_KEY"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "serve", str(model_dir), "--port", "0", "--grpc-port", "0"]
        + ["--served-model-name", "smollm2", "--num-pages", "64", "--max-num-seqs", "4"]
        + ["--max-num-batched-tokens", "64", "--attention-backend", "xla"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        target = base_url = None
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"paged-jax serving \S+ on (\S+) \(gRPC\)", line):
                target = m.group(1)
            if m := re.search(r"paged-jax OpenAI API on (http://\S+/v1)", line):
                base_url = m.group(1)
                break
        assert target is not None and base_url is not None, "".join(lines[-30:])
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        with Client(target) as client:
            deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
            while client.health() != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines[-30:])
                time.sleep(0.1)
        for where, code in ONLINE:
            code = code.replace("http://127.0.0.1:8000/v1", base_url).replace("127.0.0.1:50051", target)
            run_block(where, code, {})
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in "".join(lines)

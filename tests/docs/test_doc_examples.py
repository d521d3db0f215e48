"""The README's and the docs' examples stay true to the code: every `paged-jax ...` command in a shell block parses
with the real parser (no unknown or misspelt flag, no port clash a `serve` would refuse), and every Python block
compiles and imports only modules that exist under the names an installed wheel has (`paged_jax.serve.client`,
never the checkout-only top-level `serve`). Nothing is run: this pins the spelling, cheaply."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from serve.cli import model_arg
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

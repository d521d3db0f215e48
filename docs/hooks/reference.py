"""MkDocs hook: the configuration reference, generated from the code at build time so that it cannot drift.

A page asks for a generated block with an HTML comment on a line of its own:

- `<!-- reference: record paged_jax.config.engine:EngineConfig -->`: a table of the dataclass's fields (name,
  type, default, description). The description is the field's own comment: the `# ...` at the end of its line
  and the comment lines right above it, as the code writes them (a dataclass keeps no per-field docstring).
  The class docstring goes above the table.
- `<!-- reference: cli generate -->`: the `--help` text of a `paged-jax` subcommand, from the same argparse
  parser the command runs (`serve.main.build_parser`).

The hook also keeps the nav tolerant: a page under `user/` or `architecture/` that `mkdocs.yml` does not list is
appended to that section (so a page added by another change shows up without a nav edit).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import os
import re
import textwrap
import tokenize
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the records' modules import jax; the build needs no device

MARKER = re.compile(r"^<!-- reference: (record|cli) (\S+) -->$", re.MULTILINE)
HELP_WIDTH = 110  # columns of the rendered --help text
SECTIONS = {"user/": "User guide", "architecture/": "Architecture"}


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class body: its trailing comment, after the comment lines just above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = comments.get(node.end_lineno or node.lineno)
        text = " ".join(above + ([trailing] if trailing else []))
        out[node.target.id] = text
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        if dataclasses.is_dataclass(f.default_factory):  # a nested record: its own table says its defaults
            return f"`{f.default_factory.__name__}()`"
        return f"`{f.default_factory()!r}`"
    return "required"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_record(target: str) -> str:
    """A Markdown table of the dataclass `module:Class`, with its docstring above."""
    module_name, class_name = target.split(":")
    cls: Any = getattr(importlib.import_module(module_name), class_name)
    comments = _field_comments(cls)
    doc = inspect.getdoc(cls) or ""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append(f"| `{f.name}` | `{_cell(kind)}` | {_cell(_default(f))} | {_cell(comments.get(f.name, ''))} |")
    return f"From `{module_name}.{class_name}`:\n\n{doc}\n\n" + "\n".join(rows) + "\n"


def render_cli(command: str) -> str:
    """The `--help` text of `paged-jax COMMAND`, as a code block."""
    os.environ["COLUMNS"] = str(HELP_WIDTH)  # argparse's HelpFormatter reads the width from here
    from serve.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = subparsers.choices[command].format_help()
    return f"```text\n{text.rstrip()}\n```\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        kind, target = match.groups()
        return render_record(target) if kind == "record" else render_cli(target)

    return MARKER.sub(replace, markdown)


def on_nav(nav, config, files):
    """Append pages of a known section that the nav leaves out to that section."""
    from mkdocs.structure.nav import Section

    listed = {page.file.src_uri for page in nav.pages}
    sections = {item.title: item for item in nav.items if isinstance(item, Section)}
    for file in sorted(files.documentation_pages(), key=lambda f: f.src_uri):
        if file.src_uri in listed or file.page is None:
            continue
        for prefix, title in SECTIONS.items():
            if file.src_uri.startswith(prefix) and title in sections:
                file.page.parent = sections[title]
                sections[title].children.append(file.page)
                nav.pages.append(file.page)
    return nav

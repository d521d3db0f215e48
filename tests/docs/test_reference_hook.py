"""The docs' generated configuration reference (docs/hooks/reference.py) renders every field and flag.

`make test` builds the site strict, which fails when a record or a command cannot be imported; these tests pin
what the strict build cannot see: every field gets its row with its real default and its own comment, and the
marker syntax is the one the pages use."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from paged_jax.config.engine import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_record_has_one_row_per_field_with_its_default_and_comment(hook):
    table = hook.render_record("paged_jax.config.engine:EngineConfig")
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if line.startswith("| `")}
    assert list(rows) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert f"`{EngineConfig().max_num_seqs!r}`" in rows["max_num_seqs"]
    assert "token slots per KV page" in rows["page_size"]  # a trailing comment
    assert '"on" scans, "auto" scans on' in rows["scan_layers"]  # the comment lines above a field


def test_markers_in_the_pages_are_replaced(hook):
    page = (ROOT / "docs" / "user" / "configuration.md").read_text()
    markers = hook.MARKER.findall(page)
    assert ("record", "paged_jax.config.engine:EngineConfig") in markers and ("cli", "serve") in markers
    rendered = hook.on_page_markdown(page, None, None, None)
    assert "<!-- reference:" not in rendered
    assert "--max-num-seqs" in rendered and "| `temperature` |" in rendered


def test_cli_help_is_the_parsers_own(hook):
    text = hook.render_cli("generate")
    assert text.startswith("```text\nusage: paged-jax generate")
    assert "--input" in text and "--max-num-batched-tokens" in text

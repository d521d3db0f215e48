"""CONTRIBUTING.md and the README name only paths that exist: every `path` in backticks under one of the
repository's top-level folders (placeholders such as `<family>` and `{tpu,gpu}` are expanded or skipped)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("paged_jax/", "serve/", "pallas_kernels/", "tests/", "scripts/", "docs/", "examples/", ".ci/")
PAGES = ("CONTRIBUTING.md", "README.md")


def named_paths(text: str) -> list[str]:
    """The backticked repository paths of `text`, brace groups expanded, those with a placeholder left out."""
    out: list[str] = []
    for token in re.findall(r"`([^`\s]+)`", text):
        if not token.startswith(TOP) or "<" in token:
            continue
        parts = re.split(r"\{([^}]*)\}", token)  # "a/{x,y}/" -> ["a/", "x,y", "/"]
        choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
        out.extend("".join(c) for c in itertools.product(*choices))
    return out


def test_named_paths_expand_braces_and_skip_placeholders():
    text = "`tests/kernels/{tpu,cpu}/` `paged_jax/model/<family>.py` `make run` `serve/cli.py`"
    assert named_paths(text) == ["tests/kernels/tpu/", "tests/kernels/cpu/", "serve/cli.py"]


@pytest.mark.parametrize("page", PAGES)
def test_every_named_path_exists(page):
    paths = named_paths((ROOT / page).read_text())
    assert paths, f"{page} names no path"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"{page} names paths that do not exist: {missing}"

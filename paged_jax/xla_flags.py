"""XLA:CPU settings: which flags the process runs with, logged so a benchmark says what it measured."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def log_settings() -> str:
    """The XLA flags in effect (from `XLA_FLAGS`), printed and logged."""
    line = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    log.info(line)
    print(line)
    return line

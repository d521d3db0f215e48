"""XLA:CPU settings: which flags a process ran with (logged so that a benchmark says what it measured).

No flag is set by default: none of those tried changed a decode step on CPU (README: "XLA:CPU flags").
"""

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

"""The fronts' threads run below the engine's priority (`serve.front_priority`), and the threads they start too."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from serve.front_priority import lower_thread_priority

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_lowered_thread_and_the_threads_it_starts_run_nicer_and_the_others_do_not() -> None:
    mine = _nice()
    seen: dict[str, int] = {}

    def front() -> None:
        seen["before"] = _nice()
        assert lower_thread_priority(3)
        seen["front"] = _nice()
        child = threading.Thread(target=lambda: seen.__setitem__("child", _nice()))
        child.start()
        child.join()

    t = threading.Thread(target=front)
    t.start()
    t.join()
    assert seen == {"before": mine, "front": min(mine + 3, 19), "child": min(mine + 3, 19)}
    assert _nice() == mine  # the caller's thread (the engine's, in the server) keeps its priority


def test_zero_changes_nothing() -> None:
    mine = _nice()
    assert lower_thread_priority(0)
    assert _nice() == mine

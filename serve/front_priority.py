"""The fronts' threads run at a lower CPU priority than the engine's, so cheap requests cannot crowd out steps.

Every request is parsed, validated, tokenized and answered on the fronts' threads (the gRPC server's event loop
on the main thread, the HTTP front's, and the threads they start), while the engine loop and XLA's compute
threads run the steps. On a machine with fewer cores than threads they share the cores by the kernel's
scheduler, which weighs every thread alike: a client resending bad requests as fast as they are refused (each
answered in milliseconds) then takes as much CPU as the steps every other request waits for. Raising the
niceness of the front's threads (Linux `setpriority` on the calling thread; threads inherit it when they are
created) lets the steps run first whenever both want a core, and the fronts use the rest; with idle cores
nothing changes. The engine loop and XLA's threads are started before this is called and keep their priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> bool:
    """Add `nice` (0-19) to the calling thread's niceness, and so to every thread it starts later. False where
    the platform has no per-thread priority (not Linux); 0 changes nothing."""
    if nice == 0:
        return True
    if sys.platform != "linux":
        log.warning("--front-nice: per-thread priorities need Linux; the fronts run at the engine's priority")
        return False
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    return True

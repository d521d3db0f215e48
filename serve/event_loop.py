"""The serving process's asyncio event loop: uvloop's (libuv) where it is installed, else the standard one.

Why: every request is accepted, parsed, answered and streamed on the fronts' event loop, which shares the
interpreter and the cores with the engine loop's steps. A flood of cheap requests (bad bodies answered 400) costs
mostly event-loop and socket work (accept, read, write, close); uvloop does that work in C, so each answer takes
less of the CPU the steps need (uvicorn's httptools parser likewise, picked by uvicorn itself when installed).
gRPC's asyncio server and uvicorn both run on it. The figures are on the soak benchmark page
(`docs/benchmarks/soak.md`).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

LOOP_NAME = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What `asyncio.run(..., loop_factory=...)` takes: uvloop's loop when installed (not on Windows)."""
    if LOOP_NAME == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop

"""A server on its own asyncio loop thread (tests, embedding): the start/ready/stop mechanics shared by the
gRPC and HTTP fronts' thread wrappers. `start()` returns once the server listens (or raises its start error)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class BackgroundServer:
    """Runs `self.server` (anything with `async start()`) on a daemon thread's event loop.

    Subclasses say how the server runs once started (`_serve`) and how it shuts down (`_shutdown`)."""

    def __init__(self, server: Any, name: str) -> None:
        self.server = server
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self):
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    async def _serve(self) -> None:
        """Awaited after a successful start; returning ends the thread."""
        raise NotImplementedError

    async def _shutdown(self, grace_period_s: float) -> None:
        raise NotImplementedError

    def _main(self) -> None:
        async def run() -> None:
            self._aio_loop = asyncio.get_running_loop()
            try:
                await self.server.start()
            except BaseException as e:
                self._error = e
                raise
            finally:
                self._ready.set()
            await self._serve()

        try:
            asyncio.run(run())
        except BaseException:  # noqa: BLE001 - reported through start()
            pass

    def stop(self, grace_period_s: float = 0.0) -> None:
        if self._aio_loop is None or not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(grace_period_s), self._aio_loop).result(30)
        self._thread.join(10)

"""Stand-in aiohttp servers on 127.0.0.1: :func:`serving_app` in the test's own event loop, and
:class:`ThreadedApp` from a thread and event loop of its own, for the servers that synchronous
test code (``huggingface_hub``'s client, obstore) talks to: the fake Jobs Hub and the
fault-injecting storage gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """``app`` served on a free loopback port while the block runs; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class ThreadedApp:
    """``start()`` serves :meth:`make_app` on a free port (``url``); ``stop()`` ends it."""

    def __init__(self) -> None:
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._serve()), name=type(self).__name__, daemon=True
        )

    async def make_app(self) -> web.Application:
        """The application, built inside the server's own event loop."""
        raise NotImplementedError

    async def on_stop(self) -> None:
        """Release what :meth:`make_app` opened (after the server stopped)."""

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError(f"{type(self).__name__} did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runner = web.AppRunner(await self.make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self.on_stop()

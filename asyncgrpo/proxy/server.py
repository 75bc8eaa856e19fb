"""Start and stop the proxy: its listening socket, the aiohttp application behind it, and
the connections they share.

Clients talk to :class:`~asyncgrpo.proxy.front.Connection` (HTTP/1.1 on llhttp); what it does not
serve itself goes to the aiohttp application (:func:`~asyncgrpo.proxy.app.create_app`) on a unix
socket in a fresh 0700 directory: only this user can reach it, and it checks the API key too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from email.utils import formatdate
from functools import partial

from aiohttp import web

from asyncgrpo.proxy.app import create_app
from asyncgrpo.proxy.auth import expected_header
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.front import Connection
from asyncgrpo.proxy.h1 import H1Pool
from asyncgrpo.proxy.state import CORE

__all__ = ["Front", "serve_proxy"]

log = logging.getLogger(__name__)


class Front:
    """What the client connections share: the application's state, the pool of connections to
    it (``relay_path``), the set of open connections and the ``Date`` header of this second."""

    def __init__(self, app: web.Application, relay_path: str) -> None:
        self.core = app[CORE]
        self.config = self.core.config
        self.auth = expected_header(self.config.api_key)
        self.relay = H1Pool(path=relay_path, keepalive_s=3.0)
        self.clients: set[Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._sweeper = self.loop.create_task(self._sweep(), name="asyncgrpo-proxy-sweeper")
        self._date = (0, b"")

    async def aclose(self) -> None:
        """Close every client connection (in-flight requests are dropped) and the relay."""
        self._sweeper.cancel()
        for client in list(self.clients):
            client.close()
        self.relay.close()

    async def _sweep(self) -> None:
        """Close connections idle (or trickling a request) for ``client_idle_timeout_s``."""
        timeout = self.config.client_idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            limit = self.loop.time() - timeout
            for client in list(self.clients):
                if client.waiting_since is not None and client.waiting_since < limit:
                    client.close()

    def http_date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]


@asynccontextmanager
async def serve_proxy(config: ProxyConfig) -> AsyncIterator[str]:
    """Run the proxy in this event loop; yields its base URL (``port=0`` picks a free port)."""
    app = create_app(config)
    # Its clients (the front's relay connections) are gone when it stops: in-flight handlers
    # (streams) are cancelled after a second rather than aiohttp's default minute.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    sock_dir = tempfile.mkdtemp(prefix="asyncgrpo-proxy-")
    if len(sock_dir) > 90:  # AF_UNIX paths are limited to ~107 bytes
        shutil.rmtree(sock_dir)
        sock_dir = tempfile.mkdtemp(prefix="asyncgrpo-proxy-", dir="/tmp")
    relay_path = os.path.join(sock_dir, "app.sock")
    front: Front | None = None
    server: asyncio.Server | None = None
    await runner.setup()
    try:
        await web.UnixSite(runner, relay_path).start()
        front = Front(app, relay_path)
        server = await asyncio.get_running_loop().create_server(
            partial(Connection, front), config.host, config.port, backlog=1024
        )
        host, port = server.sockets[0].getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("proxy listening on %s", url)
        yield url
    finally:
        if server is not None:
            server.close()
        if front is not None:
            await front.aclose()
        if server is not None:
            await server.wait_closed()
        await runner.cleanup()
        shutil.rmtree(sock_dir, ignore_errors=True)

"""The service's HTTP front: aiohttp's server held to the limits the proxy's front keeps.

aiohttp parses and routes; this module bounds what a client can hold: at most
``max_connections`` connections (fitted to the open-file limit: at the cap the connections that
waited longest without a request in progress are closed, those that never sent one first, and
a new one is answered 503 when every open one is busy); a request head sent within
``head_timeout_s`` of connecting or of its first byte; the next request within
``client_idle_timeout_s``. Without them 1,040 idle connections against a 1,024-descriptor limit
made ``healthz`` time out while ``accept`` logged ``Too many open files`` without end, and a
head sent a byte at a time held its connection forever.

A connection is *busy* while one of its requests is handled (:func:`track`, the outermost
middleware): no deadline then, as a body is read under its own (:mod:`asyncgrpo.tinker.http`)
and ``retrieve_future`` long-polls on purpose.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from asyncgrpo.proxy.http.policy import connection_cap

__all__ = ["HEAD_FIELDS", "HEAD_LINE_BYTES", "Connections", "listen", "track"]

log = logging.getLogger(__name__)

#: Longest request line and longest header field (aiohttp's own bound, stated here).
HEAD_LINE_BYTES = 8190
#: Most header fields in a request head (the SDK sends about fifteen).
HEAD_FIELDS = 64
#: Seconds an answered connection keeps reading (and dropping) a body the route did not read.
LINGER_S = 2.0
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 21\r\nConnection: close\r\n\r\ntoo many connections\n"
)


class Connections:
    """The open client connections: their cap and their deadlines (:meth:`sweep`)."""

    def __init__(self, cap: int, head_s: float, idle_s: float) -> None:
        self.cap, self.head_s, self.idle_s = cap, head_s, idle_s
        self.conns: set[_Connection] = set()

    def admit(self) -> bool:
        """Make room for one more connection; False if every open one is busy."""
        if len(self.conns) < self.cap:
            return True
        waiting = [c for c in self.conns if c.deadline is not None]
        room = max(1, self.cap // 16)
        for c in heapq.nsmallest(room, waiting, key=lambda c: (c.served, c.deadline)):
            c.drop()
        return len(self.conns) < self.cap

    def sweep(self, now: float) -> None:
        """Close the connections past their deadline."""
        for c in [c for c in self.conns if c.deadline is not None and c.deadline < now]:
            c.drop()

    async def run(self) -> None:
        """Sweep a few times per shortest timeout, forever (cancel to stop)."""
        every = max(0.05, min(self.head_s, self.idle_s, 4.0) / 4)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            self.sweep(loop.time())


class _Connection(RequestHandler):  # type: ignore[misc]
    """aiohttp's protocol for one connection, counted and timed by :class:`Connections`.
    ``deadline`` (loop time): when it closes unless a request arrives; None while busy."""

    __slots__ = ("_clients", "busy", "deadline", "in_head", "refused", "served")

    def __init__(self, clients: Connections, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._clients = clients
        self.deadline: float | None = None
        self.busy = 0
        self.in_head = self.refused = self.served = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        clients = self._clients
        if not clients.admit():
            self.refused = True
            transport.write(_REFUSED)  # type: ignore[attr-defined]
            transport.close()
            return
        clients.conns.add(self)
        self.deadline = self._loop.time() + clients.head_s
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._clients.conns.discard(self)
        if not self.refused:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.busy and not self.in_head:  # a request's first byte: its head is timed
            self.in_head = True
            self.deadline = self._loop.time() + self._clients.head_s
        super().data_received(data)

    def begin(self) -> None:
        self.busy += 1
        self.in_head, self.deadline = False, None

    def end(self) -> None:
        self.busy -= 1
        self.served = True
        if not self.busy:
            self.deadline = self._loop.time() + self._clients.idle_s

    def drop(self) -> None:
        self._clients.conns.discard(self)
        self.force_close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Mark the request's connection busy while the request is handled."""
    conn = request.protocol
    if not isinstance(conn, _Connection):
        return await handler(request)
    conn.begin()
    try:
        return await handler(request)
    finally:
        conn.end()


@asynccontextmanager
async def listen(
    app: web.Application,
    host: str,
    port: int,
    *,
    max_connections: int,
    head_timeout_s: float,
    idle_timeout_s: float,
) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` under these limits for the block; yields the bound
    port."""
    handler_args: dict[str, Any] = {
        "access_log": None,
        "keepalive_timeout": idle_timeout_s,
        "lingering_time": LINGER_S,
        "max_line_size": HEAD_LINE_BYTES,
        "max_field_size": HEAD_LINE_BYTES,
        "max_headers": HEAD_FIELDS,
    }
    runner = web.AppRunner(app, handle_signals=False, **handler_args)
    await runner.setup()
    clients = Connections(
        connection_cap(max_connections, "tinker.max_connections"), head_timeout_s, idle_timeout_s
    )
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None
    sweeper: asyncio.Task[None] | None = None
    listener: asyncio.base_events.Server | None = None
    try:
        listener = await loop.create_server(
            lambda: _Connection(clients, server, loop=loop, **handler_args), host, port
        )
        sweeper = loop.create_task(clients.run())
        yield listener.sockets[0].getsockname()[1]
    finally:
        if sweeper is not None:
            sweeper.cancel()
        if listener is not None:
            listener.close()
        with anyio.CancelScope(shield=True):
            await runner.cleanup()

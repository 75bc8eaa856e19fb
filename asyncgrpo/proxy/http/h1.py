"""The proxy's one HTTP client: keep-alive HTTP/1.1 on llhttp (``httptools``), plain or TLS.

Relayed requests are callbacks: a pooled connection's ``data_received`` feeds llhttp, which calls
the waiting :class:`Exchange` back in the same callback (no task, future or stream buffer);
control calls await the same exchange (:meth:`H1Pool.fetch`). ``https://`` replicas use asyncio's
TLS transport, verified against the system's CAs (``SSL_CERT_FILE`` adds others). A reused
connection closed before a byte of the answer came is retried once on a fresh one.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import cast

import httptools

from asyncgrpo.config.proxy import split_url

__all__ = ["ConnectFailed", "Disconnected", "Exchange", "H1Pool", "Request", "Response"]

#: Idle connections kept per pool; more are closed when returned.
_MAX_IDLE = 1024
_FRAMING = (b"content-length", b"transfer-encoding")
_JSON = b"Content-Type: application/json\r\n"

#: (status, headers as (name, value) bytes pairs, body)
Response = tuple[int, list[tuple[bytes, bytes]], bytes]
#: A request as written: one piece, or its head and the body's pieces (never joined: a copy of
#: a 32 MiB body holds the event loop for tens of milliseconds)
Request = bytes | list[bytes | bytearray]


def _write(transport: asyncio.Transport, request: Request) -> None:
    if isinstance(request, bytes):
        transport.write(request)
    else:
        transport.writelines(request)


class ConnectFailed(OSError):
    """No connection to the replica could be opened."""


class Disconnected(OSError):
    """The connection broke (or spoke something other than HTTP/1.x) during the exchange."""


class Exchange:
    """The receiving end of one request on an :class:`H1Pool`: its outcome comes once, as
    :meth:`on_response` or :meth:`on_error` (:class:`ConnectFailed`, ``TimeoutError`` of the
    connect, :class:`Disconnected`). With ``streams`` set, :meth:`on_head` comes first; if it
    returns True the body comes to :meth:`on_body` piece by piece as it arrives, else with
    :meth:`on_response`."""

    __slots__ = ("conn",)
    streams = False

    def __init__(self) -> None:
        self.conn: _Conn | None = None

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        return False

    def on_body(self, data: bytes) -> None: ...

    def on_response(self, response: Response) -> None: ...

    def on_error(self, exc: OSError) -> None: ...

    def abort(self) -> None:
        """Give up on the request in flight: its connection is closed, no callback follows."""
        if (conn := self.conn) is not None:
            conn.detach()
            conn.close()

    def pause_reading(self, paused: bool) -> None:
        """Back-pressure: stop (or resume) reading the answer while its reader cannot keep up."""
        t = self.conn.transport if self.conn is not None else None
        if t is not None and not t.is_closing():
            (t.pause_reading if paused else t.resume_reading)()


class _Fetch(Exchange):
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Response]) -> None:
        super().__init__()
        self.future = future

    def on_response(self, response: Response) -> None:
        if not self.future.done():
            self.future.set_result(response)

    def on_error(self, exc: OSError) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class _Conn(asyncio.Protocol):
    """One pooled connection, idle or carrying one exchange; llhttp parses its answers.
    Interim (1xx) answers are skipped; bytes after the answer make it unusable."""

    __slots__ = (
        "body",
        "connecting",
        "done",
        "exchange",
        "head_request",
        "headers",
        "keep",
        "parser",
        "pool",
        "request",
        "reused",
        "sink",
        "started",
        "status",
        "transport",
        "used",
    )

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused, self.used = False, 0.0

    def start(self, exchange: Exchange, request: Request, head_request: bool) -> None:
        exchange.conn = self
        self.exchange, self.request, self.head_request = exchange, request, head_request
        self.sink = exchange if exchange.streams else None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.status = 0
        self.done = self.keep = self.started = False
        if self.transport is not None:
            _write(self.transport, request)

    def detach(self) -> Exchange | None:
        exchange, self.exchange, self.sink = self.exchange, None, None
        if exchange is not None:
            exchange.conn = None
        return exchange

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.transport is not None:
            self.transport.abort()

    # -- llhttp callbacks (raising after the answer: bytes nobody asked for) --------------------

    def on_message_begin(self) -> None:
        if self.done:
            raise Disconnected("a second answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.headers = []
            return
        self.status = status
        if self.sink is not None and not self.sink.on_head(status, self.headers):
            self.sink = None
        self.done = self.head_request  # no body follows, whatever the head says: no reuse

    def on_body(self, data: bytes) -> None:
        if self.done:
            raise Disconnected("a body after a HEAD answer")
        if self.sink is not None:
            self.sink.on_body(data)
        else:
            self.body.append(data)

    def on_message_complete(self) -> None:
        if self.status and not self.done:
            self.done, self.keep = True, self.parser.should_keep_alive()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # bytes nobody asked for: never reuse this connection
            return self.close()
        self.started = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self.done:
                self.close()
                if (exchange := self.detach()) is not None:
                    exchange.on_error(Disconnected(f"malformed answer: {exc}"))
                return
            self.keep = False
        if self.done and (exchange := self.detach()) is not None:  # a sink may have aborted
            if self.keep and len(self.pool.idle) < _MAX_IDLE:
                self.used, self.reused = time.monotonic(), False
                self.pool.idle.append(self)
            else:
                self.close()
            exchange.on_response((self.status, self.headers, b"".join(self.body)))

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        exchange = self.detach()
        if exchange is None:
            return
        framed = any(n.lower() in _FRAMING for n, _ in self.headers)
        if self.status and (self.done or not framed):  # complete, or delimited by the close
            exchange.on_response((self.status, self.headers, b"".join(self.body)))
        elif self.reused and not self.started:  # a keep-alive race: once more
            self.pool.send_fresh(exchange, self.request, self.head_request)
        elif self.started:
            exchange.on_error(Disconnected("answer cut short by the connection's close"))
        else:
            exchange.on_error(Disconnected("connection closed before the answer"))


class H1Pool:
    """Keep-alive connections to one replica, ``http(s)://host[:port][/prefix]``; every request
    carries ``auth`` (the upstream token) if given. ``keepalive_s`` is below the server's idle
    timeout (uvicorn's is 5 s): a pooled connection is rarely one the server is closing."""

    def __init__(
        self,
        url: str,
        *,
        auth: str | None = None,
        keepalive_s: float = 4.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        scheme, self.host, self.port, prefix = split_url(url)
        self.ssl = ssl.create_default_context() if scheme == "https" else None
        self.prefix = prefix.encode()
        self.keepalive_s, self.connect_timeout_s = keepalive_s, connect_timeout_s
        authority = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        if self.port != (443 if self.ssl else 80):
            authority += f":{self.port}"
        self.head = f"Host: {authority}\r\n".encode()
        if auth:
            self.head += f"Authorization: Bearer {auth}\r\n".encode()
        self.idle: list[_Conn] = []

    def request(
        self,
        method: bytes,
        path_qs: bytes,
        header_lines: bytes,
        body: bytes | list[bytes | bytearray],
    ) -> Request:
        """One request: ``header_lines`` ("Name: value\\r\\n", validated) + Host, Authorization,
        Content-Length; ``body`` in pieces stays in pieces."""
        size = len(body) if isinstance(body, bytes) else sum(map(len, body))
        head = (
            method,
            b" ",
            self.prefix,
            path_qs,
            b" HTTP/1.1\r\n",
            self.head,
            header_lines,
            b"Content-Length: %d\r\n\r\n" % size,
        )
        if isinstance(body, bytes):
            return b"".join((*head, body))
        return [b"".join(head), *body]

    def send(self, exchange: Exchange, request: Request, *, head_request: bool = False) -> None:
        """Send ``request`` (from :meth:`request`) on an idle connection or a new one."""
        idle, oldest = self.idle, time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            t = conn.transport
            if t is not None and not t.is_closing() and conn.used > oldest:
                conn.reused = True
                return conn.start(exchange, request, head_request)
            conn.close()
        self.send_fresh(exchange, request, head_request)

    def send_fresh(self, exchange: Exchange, request: Request, head_request: bool) -> None:
        conn = _Conn(self)
        conn.start(exchange, request, head_request)
        conn.connecting = asyncio.get_running_loop().create_task(self._connect(conn))

    async def fetch(
        self,
        method: str,
        path_qs: str,
        body: bytes | None = None,
        *,
        timeout_s: float,
        header_lines: bytes = _JSON,
    ) -> Response:
        """One whole exchange as a coroutine (control calls); raises :class:`ConnectFailed`,
        :class:`Disconnected` or ``TimeoutError`` after ``timeout_s``."""
        exchange = _Fetch(asyncio.get_running_loop().create_future())
        data = body or b""
        lines = header_lines if data else b""
        request = self.request(method.encode(), path_qs.encode(), lines, data)
        self.send(exchange, request, head_request=method == "HEAD")
        try:
            async with asyncio.timeout(timeout_s):
                return await exchange.future
        finally:
            if not exchange.future.done():  # timed out or cancelled
                exchange.abort()

    async def _connect(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        where = f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(
                    lambda: conn,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except OSError as exc:  # TimeoutError and ssl.SSLError included
            conn.connecting = None
            if (exchange := conn.detach()) is not None:
                exchange.on_error(
                    TimeoutError(f"connect to {where} took over {self.connect_timeout_s} s")
                    if isinstance(exc, TimeoutError)
                    else ConnectFailed(f"cannot connect to {where}: {type(exc).__name__}: {exc}")
                )
            return
        conn.connecting = None
        if conn.exchange is not None and conn.transport is not None:
            _write(conn.transport, conn.request)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection (in-flight ones close when their request ends)."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()

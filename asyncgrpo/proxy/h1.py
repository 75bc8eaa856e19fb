"""A keep-alive HTTP/1.1 client on llhttp (``httptools``), driven by callbacks: the proxy's hops
to the replicas (buffered generation requests) and to its own aiohttp application (the rest).

Why callbacks: every Python step between a replica's bytes arriving and the client's answer
leaving is added latency. A pooled connection's ``data_received`` feeds llhttp, which calls back
into the waiting :class:`Exchange` in the same callback: no task, no future, no stream buffer.

An exchange learns its outcome once: :meth:`Exchange.on_response`, or :meth:`Exchange.on_error`
with :class:`ConnectFailed`, ``TimeoutError`` (the connect took too long) or
:class:`Disconnected` (the connection broke mid-answer, or the answer was not HTTP/1.x). A
reused connection closed before a byte of the answer came is retried once on a fresh one
(nothing was processed). Deadlines are the caller's: :meth:`Exchange.abort`.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import httptools

__all__ = ["ConnectFailed", "Disconnected", "Exchange", "H1Pool", "Response", "ResponseParser"]

#: Idle connections kept per pool; more are closed when returned.
_MAX_IDLE = 1024

_FRAMING = (b"content-length", b"transfer-encoding")

#: (status, headers as (name, value) bytes pairs, body)
Response = tuple[int, list[tuple[bytes, bytes]], bytes]


class ConnectFailed(OSError):
    """No connection to the replica could be opened."""


class Disconnected(OSError):
    """The connection broke (or spoke something other than HTTP/1.x) during the exchange."""


class ResponseParser:
    """One HTTP/1.x answer, fed as its bytes arrive (pure: no I/O).

    :meth:`feed` returns ``(response, keep_alive)`` once the answer is complete, else None;
    :meth:`eof` ends an answer delimited by the connection's close; both raise
    :class:`Disconnected` on a malformed answer. Interim (1xx) answers are skipped; bytes after
    the answer make the connection unusable. A ``sink`` that streams gets head and body as
    they arrive.
    """

    __slots__ = ("_body", "_done", "_headers", "_keep", "_parser", "_sink", "_status",
                 "head_request", "started")  # fmt: skip

    def __init__(self, sink: Exchange | None = None, *, head_request: bool = False) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.reset(sink, head_request)

    def reset(self, sink: Exchange | None, head_request: bool) -> None:
        """Ready for the next answer on the same connection."""
        self._sink = sink if sink is not None and sink.streams else None
        self.head_request = head_request  # a HEAD request's answer has no body, whatever it says
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._status = 0
        self._done = self._keep = self.started = False

    # -- llhttp callbacks (raising after the answer: bytes nobody asked for) --------------------

    def on_message_begin(self) -> None:
        if self._done:
            raise Disconnected("a second answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._headers = []
            return
        self._status = status
        if self._sink is not None:
            self._sink.on_head(status, self._headers)
        self._done = self.head_request  # no body follows, whatever the head says: no reuse

    def on_body(self, data: bytes) -> None:
        if self._done:
            raise Disconnected("a body after a HEAD answer")
        if self._sink is not None:
            self._sink.on_body(data)
        else:
            self._body.append(data)

    def on_message_complete(self) -> None:
        if self._status and not self._done:
            self._done, self._keep = True, self._parser.should_keep_alive()

    def feed(self, data: bytes) -> tuple[Response, bool] | None:
        self.started = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if not self._done:
                raise Disconnected(f"malformed answer: {exc}") from None
            self._keep = False
        if not self._done:
            return None
        return (self._status, self._headers, b"".join(self._body)), self._keep

    def eof(self) -> Response:
        """The connection closed: the answer if it was delimited by the close."""
        framed = any(n.lower() in _FRAMING for n, _ in self._headers)
        if self._status and (self._done or not framed):
            return self._status, self._headers, b"".join(self._body)
        if not self.started:
            raise Disconnected("connection closed before the answer")
        raise Disconnected("answer cut short by the connection's close")


class Exchange:
    """The receiving end of one request on an :class:`H1Pool` (subclass and override).

    A buffering exchange gets the whole answer in :meth:`on_response`; one with ``streams`` set
    gets :meth:`on_head` and :meth:`on_body` as the bytes arrive, then :meth:`on_response`.
    """

    __slots__ = ("conn",)
    streams = False

    def __init__(self) -> None:
        self.conn: _Conn | None = None

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        pass

    def on_body(self, data: bytes) -> None:
        pass

    def on_response(self, response: Response) -> None:
        raise NotImplementedError

    def on_error(self, exc: OSError) -> None:
        raise NotImplementedError

    def pause_reading(self, paused: bool) -> None:
        """Back-pressure: stop (or resume) reading the answer while its reader cannot keep up."""
        transport = self.conn.transport if self.conn is not None else None
        if transport is not None and not transport.is_closing():
            if paused:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def abort(self) -> None:
        """Give up on the request in flight: its connection is closed, no callback follows."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()


class _Conn(asyncio.Protocol):
    """One pooled connection: idle, or carrying one exchange."""

    __slots__ = ("connecting", "exchange", "parser", "pool", "request", "reused", "transport",
                 "used")  # fmt: skip

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.request = b""
        self.reused = False
        self.parser = ResponseParser()  # one llhttp parser for the connection's answers
        self.used = 0.0

    def start(self, exchange: Exchange, request: bytes, head_request: bool) -> None:
        exchange.conn = self
        self.exchange = exchange
        self.request = request
        self.parser.reset(exchange, head_request)
        if self.transport is not None:
            self.transport.write(request)

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.transport is not None:
            self.transport.abort()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def detach(self) -> Exchange | None:
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.conn = None
        return exchange

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # bytes nobody asked for: never reuse this connection
            return self.close()
        try:
            done = self.parser.feed(data)
        except Disconnected as exc:
            exchange = cast(Exchange, self.detach())
            self.close()
            return exchange.on_error(exc)
        if done is not None:
            exchange = cast(Exchange, self.detach())
            if done[1] and len(self.pool.idle) < _MAX_IDLE:
                self.used, self.reused = time.monotonic(), False
                self.pool.idle.append(self)
            else:
                self.close()
            exchange.on_response(done[0])

    def eof_received(self) -> bool:
        return False  # close; connection_lost finishes the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        exchange = self.detach()
        if exchange is None:
            return
        try:
            response = self.parser.eof()
        except Disconnected as err:
            if self.reused and not self.parser.started:  # a keep-alive race: once more
                self.pool.send_fresh(exchange, self.request, self.parser.head_request)
            else:
                exchange.on_error(err)
            return
        exchange.on_response(response)


class H1Pool:
    """Keep-alive connections to one ``http://host:port`` server, or to a unix socket (``path``).

    ``keepalive_s`` stays below the server's own idle timeout (uvicorn's is 5 s), so a pooled
    connection is rarely one the server is closing.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 80,
        *,
        path: str | None = None,
        keepalive_s: float = 4.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.host, self.port, self.path = host, port, path
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        authority = f"[{host}]" if ":" in host else host  # an IPv6 literal
        self.host_header = f"Host: {authority}:{port}\r\n".encode("ascii")
        self.idle: list[_Conn] = []

    def request(self, method: bytes, path_qs: bytes, header_lines: bytes, body: bytes) -> bytes:
        """The bytes of one request: ``header_lines`` ("Name: value\\r\\n" each, validated by
        the caller) plus ``Host`` and ``Content-Length``."""
        return b"".join(
            (method, b" ", path_qs, b" HTTP/1.1\r\n", self.host_header, header_lines,
             b"Content-Length: %d\r\n\r\n" % len(body), body)
        )  # fmt: skip

    def send(self, exchange: Exchange, request: bytes, *, head_request: bool = False) -> None:
        """Send ``request`` (from :meth:`request`) on an idle connection or a new one."""
        idle = self.idle
        if idle:
            oldest = time.monotonic() - self.keepalive_s
            while idle:
                conn = idle.pop()
                t = conn.transport
                if t is not None and not t.is_closing() and conn.used > oldest:
                    conn.reused = True
                    conn.start(exchange, request, head_request)
                    return
                conn.close()
        self.send_fresh(exchange, request, head_request)

    def send_fresh(self, exchange: Exchange, request: bytes, head_request: bool) -> None:
        conn = _Conn(self)
        conn.start(exchange, request, head_request)
        conn.connecting = asyncio.get_running_loop().create_task(self._connect(conn))

    async def _connect(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        where = self.path or f"{self.host}:{self.port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.path is not None:
                    await loop.create_unix_connection(lambda: conn, self.path)
                else:
                    await loop.create_connection(lambda: conn, self.host, self.port)
        except OSError as exc:  # TimeoutError included
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
            conn.transport.write(conn.request)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection (in-flight ones close when their request ends)."""
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()

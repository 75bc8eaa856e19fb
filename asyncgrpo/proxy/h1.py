"""A minimal keep-alive HTTP/1.1 client for the proxy's buffered generation hop, callback-driven.

Why: a proxied request pays for every Python step between the replica's bytes arriving and the
client's answer leaving. The aiohttp client costs ~0.3 ms of CPU per request on this class of
machine (request and response objects, multidicts, timers); asyncio streams still cost a task
wake-up and several buffer operations per read. Here each pooled connection is an
:class:`asyncio.Protocol` that parses the answer in ``data_received`` and hands it to the waiting
:class:`Exchange` in the same callback: no task, no future, no stream buffer. Streaming answers,
``https`` replicas and every other call still go through aiohttp.

An exchange learns its outcome once: :meth:`Exchange.on_response`, or :meth:`Exchange.on_error`
with :class:`ConnectFailed` (the replica refused or is unreachable: trip its circuit),
``TimeoutError`` (the connect took longer than its timeout) or :class:`Disconnected` (the
connection broke mid-exchange, or the answer was not HTTP/1.x). A reused keep-alive connection
that the replica closed before answering is retried once on a fresh connection (nothing was
processed). Deadlines are the caller's: :meth:`Exchange.abort` drops the attempt and its connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import cast

__all__ = [
    "ConnectFailed",
    "Disconnected",
    "Exchange",
    "H1Pool",
    "Response",
    "ResponseParser",
    "parse_head",
]

#: Longest status line + headers accepted from a replica.
_HEAD_LIMIT = 1 << 20
#: Idle connections kept per replica; more are closed when returned.
_MAX_IDLE = 1024

# Response headers parse_head acts on (the rest are only collected).
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})

#: (status, headers as (name, value) bytes pairs, body)
Response = tuple[int, list[tuple[bytes, bytes]], bytes]


class ConnectFailed(OSError):
    """No connection to the replica could be opened."""


class Disconnected(OSError):
    """The connection broke (or spoke something other than HTTP/1.x) during the exchange."""


def parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], int | None, bool, bool]:
    """A response head (ending in a blank line): status, headers, Content-Length (None when
    chunked or absent), chunked, keep-alive. Raises :class:`Disconnected` on anything else."""
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise Disconnected(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    try:
        status = int(rest[:3])
    except ValueError:
        raise Disconnected(f"bad status line: {lines[0][:80]!r}") from None
    keep = version == b"HTTP/1.1"
    length: int | None = None
    chunked = False
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise Disconnected(f"bad header line: {line[:80]!r}")
        value = value.strip()
        lower = name.lower()
        if lower not in _FRAMING:
            pass
        elif lower == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise Disconnected(f"bad Content-Length: {value[:40]!r}") from None
        elif lower == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif lower == b"connection":
            v = value.lower()
            keep = b"close" not in v and (keep or b"keep-alive" in v)
        headers.append((name, value))
    return status, headers, None if chunked else length, chunked, keep


class ResponseParser:
    """One HTTP/1.1 response, fed as its bytes arrive (pure: no I/O).

    :meth:`feed` returns ``(response, keep_alive)`` once the answer is complete, else None;
    :meth:`eof` ends an answer delimited by the connection's close. Both raise
    :class:`Disconnected` on a malformed answer. Bytes after the answer make the connection
    unusable (``keep_alive`` False): a replica never sends an unrequested answer.
    """

    __slots__ = ("_buf", "_chunks", "_head", "_pos", "started")

    def __init__(self) -> None:
        self._buf = b""
        self._head: tuple[int, list[tuple[bytes, bytes]], int | None, bool, bool] | None = None
        self._pos = 0  # start of the body (then of the next chunk) in _buf
        self._chunks: list[bytes] = []
        self.started = False  # any byte received

    def feed(self, data: bytes) -> tuple[Response, bool] | None:
        self.started = True
        buf = self._buf = self._buf + data if self._buf else data
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _HEAD_LIMIT:
                    raise Disconnected(f"answer head over {_HEAD_LIMIT} bytes")
                return None
            head = parse_head(buf[: end + 4])
            if 100 <= head[0] < 200:  # an interim answer (100 Continue): the real one follows
                buf = self._buf = buf[end + 4 :]
                continue
            self._head = head
            self._pos = end + 4
        status, _, length, chunked, keep = self._head
        if status in (204, 304):
            return self._done(b"", self._pos, keep)
        if chunked:
            return self._feed_chunks(keep)
        if length is not None:
            end = self._pos + length
            if len(buf) < end:
                return None
            return self._done(buf[self._pos : end], end, keep)
        return None  # delimited by the close

    def _feed_chunks(self, keep: bool) -> tuple[Response, bool] | None:
        buf = self._buf
        while True:
            pos = self._pos
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                return None
            try:
                size = int(buf[pos:nl].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise Disconnected(f"bad chunk size line: {buf[pos:nl][:40]!r}") from None
            if size == 0:
                if buf[nl + 2 : nl + 4] == b"\r\n":
                    end = nl + 4
                else:  # trailers, up to a blank line
                    t = buf.find(b"\r\n\r\n", nl + 2)
                    if t < 0:
                        return None
                    end = t + 4
                return self._done(b"".join(self._chunks), end, keep)
            end = nl + 2 + size
            if len(buf) < end + 2:
                return None
            if buf[end : end + 2] != b"\r\n":
                raise Disconnected("bad chunk: no CRLF after its data")
            self._chunks.append(buf[nl + 2 : end])
            self._pos = end + 2

    def _done(self, body: bytes, end: int, keep: bool) -> tuple[Response, bool]:
        assert self._head is not None
        return (self._head[0], self._head[1], body), keep and len(self._buf) == end

    def eof(self) -> Response:
        """The connection closed: the answer if it was delimited by the close."""
        head = self._head
        if head is not None and head[2] is None and not head[3]:
            return head[0], head[1], self._buf[self._pos :]
        if head is None and not self.started:
            raise Disconnected("connection closed before the answer")
        raise Disconnected("answer cut short by the connection's close")


class Exchange:
    """The receiving end of one request on an :class:`H1Pool` (subclass and override)."""

    __slots__ = ("conn",)

    def __init__(self) -> None:
        self.conn: _Conn | None = None

    def on_response(self, response: Response) -> None:
        raise NotImplementedError

    def on_error(self, exc: OSError) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Give up on the request in flight: its connection is closed, no callback follows."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.close()


class _Conn(asyncio.Protocol):
    """One connection to a replica: idle in the pool, or carrying one exchange."""

    __slots__ = ("connecting", "exchange", "parser", "pool", "request", "reused", "transport",
                 "used")  # fmt: skip

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.request = b""
        self.reused = False
        self.parser = ResponseParser()
        self.used = time.monotonic()

    def start(self, exchange: Exchange, request: bytes) -> None:
        exchange.conn = self
        self.exchange = exchange
        self.request = request
        self.parser = ResponseParser()
        if self.transport is not None:
            self.transport.write(request)

    def usable(self, now: float) -> bool:
        return (
            self.transport is not None
            and not self.transport.is_closing()
            and now - self.used < self.pool.keepalive_s
        )

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.cancel()
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: never reuse this connection
            self.close()
            return
        try:
            done = self.parser.feed(data)
        except Disconnected as exc:
            self._fail(exc)
            return
        if done is None:
            return
        response, keep = done
        self.exchange = exchange.conn = None
        if keep:
            self.pool._give_back(self)
        else:
            self.close()
        exchange.on_response(response)

    def eof_received(self) -> bool:
        return False  # close; connection_lost finishes the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._forget(self)
        exchange = self.exchange
        if exchange is None:
            return
        self.exchange = exchange.conn = None
        try:
            response = self.parser.eof()
        except Disconnected as err:
            if self.reused and not self.parser.started:
                self.pool._send_fresh(exchange, self.request)  # a keep-alive race: once more
                return
            exchange.on_error(err)
            return
        exchange.on_response(response)

    def _fail(self, exc: OSError) -> None:
        exchange = self.exchange
        self.exchange = None
        self.close()
        if exchange is not None:
            exchange.conn = None
            exchange.on_error(exc)


class H1Pool:
    """Keep-alive connections to one ``http://host:port`` replica.

    ``keepalive_s`` stays below the replica's own idle timeout (uvicorn's is 5 s), so a pooled
    connection is rarely one the replica is closing.
    """

    def __init__(
        self, host: str, port: int, *, keepalive_s: float = 4.0, connect_timeout_s: float = 5.0
    ) -> None:
        self.host = host
        self.port = port
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        authority = f"[{host}]" if ":" in host else host  # an IPv6 literal
        self.host_header = f"Host: {authority}:{port}\r\n".encode("ascii")
        self._idle: list[_Conn] = []

    def request(self, method: bytes, path_qs: bytes, header_lines: bytes, body: bytes) -> bytes:
        """The bytes of one request to this replica: ``header_lines`` ("Name: value\\r\\n"
        each) plus ``Host`` and ``Content-Length``."""
        return b"".join(
            (method, b" ", path_qs, b" HTTP/1.1\r\n", self.host_header, header_lines,
             b"Content-Length: %d\r\n\r\n" % len(body), body)
        )  # fmt: skip

    def send(self, exchange: Exchange, request: bytes) -> None:
        """Send ``request`` (from :meth:`request`) on an idle connection or a new one."""
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                conn.reused = True
                conn.start(exchange, request)
                return
            conn.close()
        self._send_fresh(exchange, request)

    def _send_fresh(self, exchange: Exchange, request: bytes) -> None:
        conn = _Conn(self)
        conn.start(exchange, request)
        conn.connecting = asyncio.get_running_loop().create_task(self._connect(conn))

    async def _connect(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: conn, self.host, self.port)
        except OSError as exc:  # TimeoutError included
            conn.connecting = None
            where = f"{self.host}:{self.port}"
            conn._fail(
                TimeoutError(f"connect to {where} took over {self.connect_timeout_s} s")
                if isinstance(exc, TimeoutError)
                else ConnectFailed(f"cannot connect to {where}: {type(exc).__name__}: {exc}")
            )
            return
        conn.connecting = None
        if conn.exchange is not None and conn.transport is not None:
            conn.transport.write(conn.request)
        elif conn.transport is not None:
            conn.close()

    def _give_back(self, conn: _Conn) -> None:
        if len(self._idle) < _MAX_IDLE:
            conn.used = time.monotonic()
            conn.reused = False
            self._idle.append(conn)
        else:
            conn.close()

    def _forget(self, conn: _Conn) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        """Close every idle connection (in-flight ones close when their request ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def post(self, path_qs: str, headers: Iterable[tuple[str, str]], body: bytes) -> Response:
        """POST ``body`` and wait for the answer (a coroutine over :meth:`send`)."""
        fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        exchange = _FutureExchange(fut)
        lines = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        self.send(exchange, self.request(b"POST", path_qs.encode(), lines, body))
        try:
            return await fut
        finally:
            if not fut.done():
                exchange.abort()


class _FutureExchange(Exchange):
    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future[Response]) -> None:
        super().__init__()
        self.fut = fut

    def on_response(self, response: Response) -> None:
        if not self.fut.done():
            self.fut.set_result(response)

    def on_error(self, exc: OSError) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)

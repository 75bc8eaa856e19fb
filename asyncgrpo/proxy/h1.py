"""A minimal keep-alive HTTP/1.1 client for the proxy's non-streaming generation hop.

Why: the aiohttp client costs ~0.3 ms of CPU per request on this class of machine (request and
response objects, multidicts, timers, payload wrappers), the largest single item of the proxy's
per-request cost; writing one request and reading one ``Content-Length`` (or chunked) answer on a
pooled ``asyncio`` stream costs ~0.08 ms. Streaming answers, ``https`` replicas and every other
call still go through aiohttp. Deadlines are the caller's (``asyncio.timeout`` around
:meth:`H1Pool.post`); a connection interrupted in any way is closed, never reused.

Errors: :class:`ConnectFailed` (the replica refused or is unreachable: trip its circuit) and
:class:`Disconnected` (the connection broke mid-exchange, or the answer was not HTTP/1.x); a
connect that times out raises ``TimeoutError``. A reused keep-alive connection that the replica
closed before answering is retried once on a fresh connection (nothing was processed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

__all__ = ["ConnectFailed", "Disconnected", "H1Pool", "parse_head"]

#: Longest status line + headers accepted from a replica.
_HEAD_LIMIT = 1 << 20
#: Idle connections kept per replica; more are closed when returned.
_MAX_IDLE = 1024


class ConnectFailed(OSError):
    """No connection to the replica could be opened."""


class Disconnected(OSError):
    """The connection broke (or spoke something other than HTTP/1.x) during the exchange."""


class _Conn:
    __slots__ = ("reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()

    def usable(self, now: float, keepalive_s: float) -> bool:
        return (
            now - self.used < keepalive_s
            and not self.reader.at_eof()
            and not self.writer.transport.is_closing()
        )

    def close(self) -> None:
        self.writer.transport.abort()


class H1Pool:
    """Keep-alive connections to one ``http://host:port`` replica.

    ``keepalive_s`` stays below the replica's own idle timeout (uvicorn's is 5 s), so a pooled
    connection is rarely one the replica is closing.
    """

    def __init__(self, host: str, port: int, *, keepalive_s: float = 4.0) -> None:
        self.host = host
        self.port = port
        self.keepalive_s = keepalive_s
        authority = f"[{host}]" if ":" in host else host  # an IPv6 literal
        self._host_header = f"Host: {authority}:{port}\r\n".encode("ascii")
        self._idle: list[_Conn] = []

    async def _connect(self, connect_timeout_s: float | None) -> _Conn:
        try:
            async with asyncio.timeout(connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=_HEAD_LIMIT
                )
        except OSError as exc:
            raise ConnectFailed(
                f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}: {exc}"
            ) from None
        return _Conn(reader, writer)

    def _take(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self.keepalive_s):
                return conn
            conn.close()
        return None

    def close(self) -> None:
        """Close every idle connection (in-flight ones close when their request ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def post(
        self,
        path_qs: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        *,
        connect_timeout_s: float | None = None,
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """POST ``body``; returns (status, response headers, response body)."""
        head = [f"POST {path_qs} HTTP/1.1\r\n".encode(), self._host_header]
        for k, v in headers:
            head.append(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape"))
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        request = b"".join(head) + body
        conn = self._take()
        if conn is not None:
            try:
                return await self._exchange(conn, request)
            except _ClosedBeforeAnswer:
                pass  # the replica closed the idle connection: retry once on a fresh one
        conn = await self._connect(connect_timeout_s)
        try:
            return await self._exchange(conn, request)
        except _ClosedBeforeAnswer as exc:
            raise Disconnected(str(exc)) from None

    async def _exchange(
        self, conn: _Conn, request: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        reusable = False
        try:
            try:
                conn.writer.write(request)
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _ClosedBeforeAnswer("connection closed before the answer") from None
                raise Disconnected("connection closed inside the answer's headers") from None
            except (ConnectionError, asyncio.LimitOverrunError) as exc:
                raise Disconnected(f"{type(exc).__name__}: {exc}") from None
            status, headers, length, chunked, keep = parse_head(head)
            try:
                if chunked:
                    data = await _read_chunked(conn.reader)
                elif length is not None:
                    data = await conn.reader.readexactly(length)
                elif status in (204, 304) or 100 <= status < 200:
                    data = b""
                else:
                    data = await conn.reader.read()  # delimited by the close
                    keep = False
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise Disconnected(f"answer cut short: {type(exc).__name__}") from None
            except (asyncio.LimitOverrunError, ValueError) as exc:
                raise Disconnected(f"bad chunked answer: {exc}") from None
            reusable = keep
            return status, headers, data
        finally:
            if reusable and len(self._idle) < _MAX_IDLE:
                conn.used = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()


class _ClosedBeforeAnswer(Exception):
    pass


def parse_head(
    head: bytes,
) -> tuple[int, list[tuple[str, str]], int | None, bool, bool]:
    """A response head (ending in a blank line): status, headers, Content-Length (None when
    chunked or absent), chunked, keep-alive. Raises :class:`Disconnected` on anything else."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise Disconnected(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    try:
        status = int(rest[:3])
    except ValueError:
        raise Disconnected(f"bad status line: {lines[0][:80]!r}") from None
    keep = version == "HTTP/1.1"
    length: int | None = None
    chunked = False
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise Disconnected(f"bad header line: {line[:80]!r}")
        value = value.strip()
        lower = name.lower()
        if lower == "content-length":
            try:
                length = int(value)
            except ValueError:
                raise Disconnected(f"bad Content-Length: {value[:40]!r}") from None
        elif lower == "transfer-encoding":
            chunked = "chunked" in value.lower()
        elif lower == "connection":
            v = value.lower()
            keep = "close" not in v and (keep or "keep-alive" in v)
        headers.append((name, value))
    return status, headers, None if chunked else length, chunked, keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)

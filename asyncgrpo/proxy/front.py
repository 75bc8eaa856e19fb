"""The proxy's listening socket: a lean HTTP/1.1 server in front of the aiohttp application.

Why: the aiohttp server costs about a quarter of a millisecond of CPU per request (request
and response objects, multidicts, URL dispatch, middlewares) — more than routing and forwarding
together. A rollout client sends thousands of small completion requests per second, so the one
hot path, a non-streaming ``/v1/completions`` or ``/v1/chat/completions``, is served here, by
callbacks: each client connection is an :class:`asyncio.Protocol` whose ``data_received`` parses
the head with a few bytes operations and starts a :class:`~asyncgrpo.proxy.unary.UnaryRequest`
(routing, retries and error mapping shared with the aiohttp handler); the replica connection's
``data_received`` writes the answer back. No task, future or stream buffer sits on that path.

Everything else — streaming completions, the broadcast control calls, ``/metrics``, ``/health``,
read-only pass-through — is relayed byte for byte, in a task, to the aiohttp application, which
listens on a unix socket in a private (0700) directory, and its answer is relayed back as it
arrives (chunked streams chunk by chunk). So each endpoint has one implementation, and only the
hot path skips aiohttp.

Handled here: keep-alive and pipelining (answers in order; a client that pipelines without reading
is paused), ``Expect: 100-continue``, chunked request bodies, the inbound API key (checked for
every request, before the body is read), the body size limit (413), malformed heads (400), heads
over 64 KiB (431), connections idle (or trickling a request) for ``client_idle_timeout_s`` closed
by a sweeper, not by a timer per request.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

from aiohttp import web

from asyncgrpo.proxy.app import _loads, create_app
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.h1 import Response, parse_head
from asyncgrpo.proxy.headers import DROP_REQUEST_B, DROP_RESPONSE_B
from asyncgrpo.proxy.state import CORE, Core, error_body
from asyncgrpo.proxy.unary import UnaryRequest, request_chains

__all__ = ["HEAD_LIMIT", "Front", "serve_proxy"]

log = logging.getLogger(__name__)

#: Longest request or response head (request line or status line plus headers).
HEAD_LIMIT = 64 * 1024
#: Seconds a connection closed after an error keeps reading (and dropping) what the client sends.
LINGER_S = 2.0

_GENERATE = frozenset({b"/v1/completions", b"/v1/chat/completions"})
# Framing and per-hop headers of the client's request, rebuilt for the relay hop.
_REFRAME = frozenset({b"content-length", b"transfer-encoding", b"expect", b"connection",
                      b"keep-alive"})  # fmt: skip
# Request headers parse_request_head acts on (the rest are only collected).
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"expect", b"connection"})
_WHITESPACE = b" \t"


class _HttpError(Exception):
    """The request cannot be read; answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request:
    __slots__ = ("body", "chunked", "expect", "headers", "keep_alive", "length", "method",
                 "path", "target")  # fmt: skip

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes, bytes]],
        length: int | None,
        chunked: bool,
        expect: bool,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.path = target.partition(b"?")[0]
        self.headers = headers  # (lower-case name, value, the whole line)
        self.length = length
        self.chunked = chunked
        self.expect = expect
        self.keep_alive = keep_alive
        self.body: bytes | None = None  # None: still to be read (chunked or Expect)


def parse_request_head(head: bytes, auth: bytes | None, max_body: int) -> _Request:
    """A request head (without its blank line) -> :class:`_Request`; raises :class:`_HttpError`.

    Checks what can be refused before the body is read: framing, the API key, the size limit.
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1]:
        raise _HttpError(400, f"malformed request line {lines[0][:80]!r}")
    method, target, version = parts
    headers = []
    length: int | None = None
    chunked = False
    expect = False
    keep = version == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[0] in _WHITESPACE or name[-1] in _WHITESPACE:
            raise _HttpError(400, f"malformed header line {line[:80]!r}")
        lower = name.lower()
        value = value.strip()
        if lower not in _FRAMING:
            pass
        elif lower == b"content-length":
            if not value.isdigit() or (length is not None and length != int(value)):
                raise _HttpError(400, f"bad Content-Length {value[:40]!r}")
            length = int(value)
        elif lower == b"transfer-encoding":
            if value.lower().rsplit(b",", 1)[-1].strip() != b"chunked":
                raise _HttpError(400, f"unsupported Transfer-Encoding {value[:40]!r}")
            chunked = True
        elif lower == b"expect":
            expect = value.lower() == b"100-continue"
        elif lower == b"connection":
            tokens = value.lower()
            keep = b"close" not in tokens and (keep or b"keep-alive" in tokens)
        headers.append((lower, value, line))
    if chunked and length is not None:
        raise _HttpError(400, "both Content-Length and Transfer-Encoding")  # smuggling
    if auth is not None:
        got = next((v for n, v, _ in headers if n == b"authorization"), b"")
        if not hmac.compare_digest(got, auth):
            raise _HttpError(401, "missing or wrong 'Authorization: Bearer <key>'")
    if length is not None and length > max_body:
        raise _HttpError(413, f"request body too large: {length} bytes > {max_body}")
    return _Request(method, target, headers, length, chunked, expect, keep)


class _State(enum.Enum):
    READING = "reading"  # waiting for (the rest of) a request
    ANSWERING = "answering"  # a request is being answered; later bytes wait in the buffer
    LINGERING = "lingering"  # an error was sent; dropping input until the client closes
    CLOSED = "closed"


class Front:
    """Owns the client connections; see the module docstring.

    ``relay_path`` is the unix socket of the aiohttp application built by
    :func:`asyncgrpo.proxy.app.create_app` (its upstream pool, router and counters are shared).
    """

    def __init__(self, app: web.Application, relay_path: str) -> None:
        self.core: Core = app[CORE]
        self.config = self.core.config
        key = self.config.api_key
        self.auth = f"Bearer {key}".encode() if key else None
        self.relay_path = relay_path
        self.relay_idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.clients: set[_Client] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._date = (0, b"")
        self.loop = asyncio.get_running_loop()

    def protocol(self) -> _Client:
        """The ``protocol_factory`` for :meth:`asyncio.loop.create_server`."""
        return _Client(self)

    def start(self) -> None:
        """Start the sweeper that closes idle and trickling connections."""
        self._sweeper = asyncio.create_task(self._sweep(), name="asyncgrpo-proxy-sweeper")

    async def aclose(self) -> None:
        """Close every client connection (in-flight requests are dropped) and the relay."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = []
        for client in list(self.clients):
            if client.task is not None:
                tasks.append(client.task)
            client.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, w in self.relay_idle:
            w.transport.abort()
        self.relay_idle.clear()

    async def _sweep(self) -> None:
        timeout = self.config.client_idle_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            limit = loop.time() - timeout
            for client in list(self.clients):
                if client.waiting_since is not None and client.waiting_since < limit:
                    client.close()

    def http_date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]


class _Client(asyncio.Protocol):
    """One client connection: parses requests from its buffer and answers them in order."""

    __slots__ = ("_more", "_more_len", "_processing", "_waiter", "buf", "eof", "front",
                 "keep_alive", "loop", "pending", "reading_paused", "state", "task", "transport",
                 "unary", "waiting_since", "writing_paused")  # fmt: skip

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.state = _State.READING
        self.waiting_since: float | None = self.loop.time()  # None while answering
        self.pending: tuple[_Request, int] | None = None  # a parsed head, body incomplete
        self._more: list[bytes] = []  # segments of that body not yet joined onto buf
        self._more_len = 0
        self.keep_alive = True  # of the request being answered
        self.unary: UnaryRequest | None = None
        self.task: asyncio.Task[None] | None = None  # the slow path (relay, streamed bodies)
        self.eof = False
        self.reading_paused = False
        self.writing_paused = False
        self._waiter: asyncio.Future[None] | None = None  # the slow path waits for input/drain
        self._processing = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.front.clients.add(self)

    def data_received(self, data: bytes) -> None:
        if self.state is _State.LINGERING:
            return
        if self.pending is not None and self.state is _State.READING:
            # A large body arrives in many segments: join once, when it is all here.
            self._more.append(data)
            self._more_len += len(data)
            if len(self.buf) + self._more_len < self.pending[1]:
                return
            self.buf = b"".join([self.buf, *self._more])
            self._more, self._more_len = [], 0
        else:
            self.buf = self.buf + data if self.buf else data
        if self.state is _State.READING:
            self._process()
        else:
            self._wake()
            if self.state is _State.ANSWERING and self.task is None and len(self.buf) > HEAD_LIMIT:
                self._pause_reading()  # pipelined input piling up behind an answer

    def eof_received(self) -> bool:
        """The client closed its side: it is gone (like uvicorn and aiohttp, no half-close).

        Its request in flight is dropped, so the replica (vLLM aborts a request whose
        connection closes) stops generating an answer nobody will read.
        """
        self.eof = True
        self._wake()
        if self.state is not _State.ANSWERING or self.task is None:
            self.close()
        # The slow path may still be reading a request body: it sees ``eof`` and ends.
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _State.CLOSED
        self.front.clients.discard(self)
        self.waiting_since = None
        if self.unary is not None:
            self.unary.cancel()
            self.unary = None
        if self.task is not None:
            self.task.cancel()
        self._wake()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        self._wake()
        if self.state is _State.READING:
            self._process()

    # -- requests ------------------------------------------------------------------------------

    def _process(self) -> None:
        """Start answering every complete request in the buffer, in order (no recursion: an
        answer given synchronously comes back here through :meth:`_answered`)."""
        if self._processing:
            return
        self._processing = True
        try:
            while self.state is _State.READING and not self.writing_paused:
                try:
                    req = self._next_request()
                except _HttpError as exc:
                    self._reject(exc)
                    return
                if req is None:
                    if self.eof:
                        self.close()
                    return
                self.waiting_since = None
                self.state = _State.ANSWERING
                self.keep_alive = req.keep_alive
                self._dispatch(req)
        finally:
            self._processing = False

    def _next_request(self) -> _Request | None:
        """The next request whose body is here (or that the slow path reads itself)."""
        if self.pending is None:
            buf = self.buf
            if buf[:2] == b"\r\n":  # RFC 9112 2.2: ignore empty lines before a request line
                buf = self.buf = buf.lstrip(b"\r\n")
            end = buf.find(b"\r\n\r\n")
            if end < 0 or end > HEAD_LIMIT:
                if len(buf) > HEAD_LIMIT:
                    raise _HttpError(431, f"request head over {HEAD_LIMIT} bytes")
                return None
            front = self.front
            req = parse_request_head(buf[:end], front.auth, front.config.max_body_bytes)
            if req.chunked or req.expect:
                self.buf = buf[end + 4 :]
                return req  # the slow path reads the body
            start, stop = end + 4, end + 4 + (req.length or 0)
            if len(buf) >= stop:  # the usual case: head and body arrived together
                req.body, self.buf = buf[start:stop], buf[stop:]
                return req
            self.buf = buf[start:]
            self.pending = (req, req.length or 0)
        req, length = self.pending
        if len(self.buf) < length:
            return None
        self.pending = None
        req.body, self.buf = self.buf[:length], self.buf[length:]
        return req

    def _dispatch(self, req: _Request) -> None:
        if req.method == b"POST" and req.path in _GENERATE and req.body is not None:
            try:
                parsed = _loads(req.body)
            except ValueError:
                parsed = None  # aiohttp's handler has the lenient fallback and the messages
            if isinstance(parsed, dict) and parsed.get("stream") is not True:
                core = self.front.core
                lines = b"".join(
                    [
                        line + b"\r\n"
                        for lower, _, line in req.headers
                        if lower not in DROP_REQUEST_B
                    ]
                )
                try:
                    chains = request_chains(core, parsed)
                except Exception:  # a router bug must not cost the request: route it unmatched
                    log.exception("no routing key for %r", req.target)
                    chains = []
                self.unary = UnaryRequest(
                    core,
                    self.loop,
                    req.target,
                    req.body,
                    chains,
                    lines + core.pool.header_lines,
                    self._on_unary_answer,
                )
                self.unary.start()
                return
        self.task = self.loop.create_task(self._slow(req))

    def _on_unary_answer(self, answer: Response) -> None:
        self.unary = None
        status, headers, body = answer
        self._write_answer(status, headers, body, self.keep_alive)
        self._answered()

    def _answered(self) -> None:
        if self.state is not _State.ANSWERING:
            return
        if not self.keep_alive:
            self.close()
            return
        self.state = _State.READING
        self.waiting_since = self.loop.time()
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
        self._process()

    def _reject(self, exc: _HttpError) -> None:
        """Answer an unreadable request and close, reading (and dropping) input for a moment:
        closing with unread input makes the kernel send a reset, which can destroy the error
        answer before the client reads it (a client still sending a large body or head)."""
        self.front.core.stats.reject(exc.status)
        self._write_answer(exc.status, [], error_body(exc.status, str(exc)), False)
        self.state = _State.LINGERING
        self.buf = b""
        transport = self.transport
        if transport is None:
            return
        if transport.can_write_eof():
            transport.write_eof()
        if self.eof:
            self.close()
        else:
            self.loop.call_later(LINGER_S, self.close)

    def close(self) -> None:
        """Close gracefully (what was written is still sent); in-flight work is dropped."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        if self.unary is not None:
            self.unary.cancel()
            self.unary = None
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _write_answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, keep: bool
    ) -> None:
        """Write a buffered answer; per-hop headers in ``headers`` are dropped, framing added."""
        if self.transport is None or self.state is _State.CLOSED:
            return
        parts = [_status_line(status)]
        has_type = False
        for k, v in headers:
            lower = k.lower()
            if lower in DROP_RESPONSE_B:
                continue
            if lower == b"content-type":
                has_type = True
            parts += (k, b": ", v, b"\r\n")
        if not has_type:
            parts.append(b"Content-Type: application/json\r\n")
        parts.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self.front.http_date(), len(body)))
        if not keep:
            parts.append(b"Connection: close\r\n")
        parts += (b"\r\n", body)
        self.transport.write(b"".join(parts))

    # -- the slow path: a task that may wait for input and for the client to drain ---------------

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self.state is _State.CLOSED:
            raise ConnectionResetError("client connection closed")
        self._waiter = self.loop.create_future()
        await self._waiter

    async def _read_until(self, sep: bytes, limit: int) -> bytes:
        while True:
            i = self.buf.find(sep)
            if i >= 0:
                line, self.buf = self.buf[: i + len(sep)], self.buf[i + len(sep) :]
                return line
            if len(self.buf) > limit:
                raise _HttpError(400, "malformed chunked request body")
            if self.eof:
                raise _HttpError(400, "connection closed inside the request body")
            await self._wait()

    async def _read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise _HttpError(400, "connection closed inside the request body")
            await self._wait()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    async def _drain(self) -> None:
        while self.writing_paused:
            await self._wait()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and self.state is not _State.CLOSED:
            self.transport.write(data)

    async def _slow(self, req: _Request) -> None:
        try:
            try:
                if req.body is None:
                    req.body = await self._read_body(req)
                keep = await self._relay(req)
            except _HttpError as exc:
                self._reject(exc)
                return
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()  # the client or the relay went away
                return
            except Exception:
                log.exception("proxy failed on %s %r", req.method.decode(), req.target)
                self._write_answer(500, [], error_body(500, "proxy error"), False)
                self.close()
                return
            self.keep_alive = keep
        except asyncio.CancelledError:
            return  # the connection closed (client gone, sweeper, shutdown)
        finally:
            self.task = None
        self._answered()

    async def _read_body(self, req: _Request) -> bytes:
        limit = self.front.config.max_body_bytes
        if req.expect and (req.length or req.chunked):
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not req.chunked:
            return await self._read_exactly(req.length or 0)
        parts = []
        total = 0
        while True:
            size_line = await self._read_until(b"\r\n", 1024)
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _HttpError(400, "malformed chunked request body") from None
            if size == 0:
                while (await self._read_until(b"\r\n", HEAD_LIMIT)) != b"\r\n":
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > limit:
                raise _HttpError(413, f"request body too large: over {limit} bytes")
            parts.append(await self._read_exactly(size))
            if await self._read_exactly(2) != b"\r\n":
                raise _HttpError(400, "malformed chunked request body")

    # -- relay to the aiohttp application -----------------------------------------------------

    async def _relay(self, req: _Request) -> bool:
        """Forward ``req`` to the aiohttp application and its answer back; returns keep-alive."""
        assert req.body is not None
        front = self.front
        head = [req.method + b" " + req.target + b" HTTP/1.1\r\n"]
        head.extend(line + b"\r\n" for lower, _, line in req.headers if lower not in _REFRAME)
        head.append(b"Content-Length: %d\r\n\r\n" % len(req.body))
        request = b"".join(head) + req.body
        conn = front.relay_idle.pop() if front.relay_idle else None
        if conn is not None:
            try:
                return await self._exchange(req, request, *conn)
            except _StaleConnection:
                pass  # aiohttp closed the idle connection: once more on a fresh one
        try:
            conn = await asyncio.open_unix_connection(front.relay_path, limit=HEAD_LIMIT)
        except OSError as exc:
            log.error("relay to the proxy's application failed: %s", exc)
            self._write_answer(502, [], error_body(502, "proxy internal relay failed"), False)
            return False
        try:
            return await self._exchange(req, request, *conn)
        except _StaleConnection:
            self._write_answer(502, [], error_body(502, "proxy internal relay failed"), False)
            return False

    async def _exchange(
        self, req: _Request, request: bytes, r: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> bool:
        reusable = False
        try:
            w.write(request)
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _StaleConnection from None
                raise
            status, _, length, chunked, keep_upstream = parse_head(head)
            out = [  # the head as aiohttp wrote it, less what belongs to the relay hop
                line + b"\r\n"
                for line in head[:-4].split(b"\r\n")
                if line.partition(b":")[0].strip().lower() not in (b"connection", b"keep-alive")
            ]
            no_body = req.method == b"HEAD" or status in (204, 304) or status < 200
            keep = req.keep_alive and (no_body or chunked or length is not None)
            if not keep:
                out.append(b"Connection: close\r\n")
            out.append(b"\r\n")
            self._write(b"".join(out))
            if no_body:
                pass
            elif chunked:
                while True:
                    size_line = await r.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        trailer = size_line
                        while True:
                            line = await r.readuntil(b"\r\n")
                            trailer += line
                            if line == b"\r\n":
                                break
                        self._write(trailer)
                        break
                    self._write(size_line + await r.readexactly(size + 2))
                    await self._drain()
            elif length is not None:
                while length:
                    chunk = await r.read(min(length, 1 << 16))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length)
                    length -= len(chunk)
                    self._write(chunk)
                    await self._drain()
            else:
                while chunk := await r.read(1 << 16):
                    self._write(chunk)
                    await self._drain()
                keep_upstream = False
            reusable = keep_upstream
            return keep
        finally:
            if reusable:
                self.front.relay_idle.append((r, w))
            else:
                w.transport.abort()


class _StaleConnection(Exception):
    """The pooled relay connection was closed before it answered (nothing was processed)."""


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b"Unknown"
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


@asynccontextmanager
async def serve_proxy(config: ProxyConfig) -> AsyncIterator[str]:
    """Run the proxy in this event loop; yields its base URL (``port=0`` picks a free port).

    The aiohttp application listens on a unix socket in a fresh 0700 directory (only this user
    can reach it, and it checks the API key too); clients talk to :class:`Front`.
    """
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
        front.start()
        server = await asyncio.get_running_loop().create_server(
            front.protocol, config.host, config.port, backlog=1024
        )
        host, port = server.sockets[0].getsockname()[:2]
        if ":" in host:
            host = f"[{host}]"
        url = f"http://{host}:{port}"
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

"""The proxy's listening socket: a lean HTTP/1.1 server in front of the aiohttp application.

Why: the aiohttp server costs about a quarter of a millisecond of CPU per request (request
and response objects, multidicts, URL dispatch, middlewares) — more than routing and forwarding
together. A rollout client sends thousands of small completion requests per second, so the one
hot path, a non-streaming ``/v1/completions`` or ``/v1/chat/completions``, is served here: the
head is parsed with a few bytes operations and the request goes through
:func:`asyncgrpo.proxy.app.generate_unary` (the same routing, retries and error mapping as the
aiohttp handler). Everything else — streaming completions, the broadcast control calls,
``/metrics``, ``/health``, read-only pass-through — is relayed byte for byte to the aiohttp
application, which listens on a unix socket in a private (0700) directory, and its answer is
relayed back as it arrives (chunked streams chunk by chunk). So each endpoint has one
implementation, and only the hot path skips aiohttp.

Handled here: keep-alive and pipelining (answers in order), ``Expect: 100-continue``, chunked
request bodies, the inbound API key (checked for every request, before the body is read), the
body size limit (413), malformed heads (400), heads over 64 KiB (431), connections idle (or
trickling a request) for ``client_idle_timeout_s`` closed by a sweeper, not by a timer per
request.
"""

from __future__ import annotations

import asyncio
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
from typing import Any

from aiohttp import web

from asyncgrpo.proxy.app import _DROP_REQUEST, _loads, create_app, generate_unary
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.h1 import parse_head
from asyncgrpo.proxy.state import CONFIG, POOL, STATS, error_body

__all__ = ["HEAD_LIMIT", "Front", "serve_proxy"]

log = logging.getLogger(__name__)

#: Longest request or response head (request line or status line plus headers).
HEAD_LIMIT = 64 * 1024

_GENERATE = frozenset({b"/v1/completions", b"/v1/chat/completions"})
# Framing and per-hop headers of the client's request, rebuilt for the relay hop.
_REFRAME = frozenset({b"content-length", b"transfer-encoding", b"expect", b"connection",
                      b"keep-alive"})  # fmt: skip
_DROP_REQUEST_B = frozenset(h.encode() for h in _DROP_REQUEST)


class _HttpError(Exception):
    """The request cannot be read; answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "path", "target")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes, bytes]],
        body: bytes,
        keep_alive: bool,
    ) -> None:
        self.method = method
        self.target = target
        self.path = target.partition(b"?")[0]
        self.headers = headers  # (lower-case name, name, value)
        self.body = body
        self.keep_alive = keep_alive


class Front:
    """Serves client connections (``asyncio.start_server`` callback); see the module docstring.

    ``relay_path`` is the unix socket of the aiohttp application built by
    :func:`asyncgrpo.proxy.app.create_app` (its upstream pool, router and counters are shared).
    """

    def __init__(self, app: web.Application, relay_path: str) -> None:
        self.app = app
        self.config = app[CONFIG]
        self.stats = app[STATS]
        key = self.config.api_key
        self._auth = f"Bearer {key}".encode() if key else None
        self._relay_path = relay_path
        self._relay_idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        # Connection task -> loop time since which it waits for (the rest of) a request; absent
        # while the request is being answered.
        self._waiting: dict[asyncio.Task[Any], float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._date = (0, b"")

    def start(self) -> None:
        """Start the sweeper that closes idle and trickling connections."""
        self._sweeper = asyncio.create_task(self._sweep(), name="asyncgrpo-proxy-sweeper")

    async def aclose(self) -> None:
        """Cancel every connection's task (in-flight requests included) and close the relay."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, w in self._relay_idle:
            w.transport.abort()
        self._relay_idle.clear()

    # -- connections -----------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        waiting = self._waiting
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    waiting[task] = loop.time()
                    head = await _read_head(reader)
                    if head is None:
                        return
                    req = await self._read_request(head, reader, writer)
                    del waiting[task]
                except _HttpError as exc:
                    self.stats.reject(exc.status)
                    self._write(writer, exc.status, [], error_body(exc.status, str(exc)), False)
                    await _linger(reader, writer)
                    return
                try:
                    keep = await self._handle(req, writer)
                except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                    raise
                except Exception:
                    log.exception("proxy failed on %s %r", req.method.decode(), req.target)
                    self._write(writer, 500, [], error_body(500, "proxy error"), False)
                    keep = False
                await writer.drain()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return  # the client went away
        except asyncio.CancelledError:
            # The sweeper (idle client) or aclose() (shutdown). Ending normally: asyncio's
            # start_server callback logs an error for a connection task that ends cancelled.
            return
        finally:
            self._tasks.discard(task)
            waiting.pop(task, None)
            writer.close()

    async def _sweep(self) -> None:
        timeout = self.config.client_idle_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            limit = asyncio.get_running_loop().time() - timeout
            for task, since in list(self._waiting.items()):
                if since < limit:
                    task.cancel()  # serve() ends quietly and closes the connection

    async def _read_request(
        self, head: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> _Request:
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
            if not sep or not name or name != name.strip():
                raise _HttpError(400, f"malformed header line {line[:80]!r}")
            lower = name.lower()
            value = value.strip()
            if lower == b"content-length":
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
            headers.append((lower, name, value))
        if chunked and length is not None:
            raise _HttpError(400, "both Content-Length and Transfer-Encoding")  # smuggling
        if self._auth is not None:
            got = next((v for n, _, v in headers if n == b"authorization"), b"")
            if not hmac.compare_digest(got, self._auth):
                raise _HttpError(401, "missing or wrong 'Authorization: Bearer <key>'")
        limit = self.config.max_body_bytes
        if length is not None and length > limit:
            raise _HttpError(413, f"request body too large: {length} bytes > {limit}")
        if expect and (length or chunked):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if chunked:
            body = await _read_chunked(reader, limit)
        elif length:
            body = await reader.readexactly(length)
        else:
            body = b""
        return _Request(method, target, headers, body, keep)

    # -- requests ----------------------------------------------------------------------------

    async def _handle(self, req: _Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; returns whether the connection stays open."""
        if req.method == b"POST" and req.path in _GENERATE:
            try:
                parsed = _loads(req.body)
            except ValueError:
                parsed = None  # aiohttp's handler has the lenient fallback and the messages
            if isinstance(parsed, dict) and parsed.get("stream") is not True:
                pool = self.app[POOL]
                headers = {
                    n.decode("latin-1"): v.decode("latin-1")
                    for lower, n, v in req.headers
                    if lower not in _DROP_REQUEST_B
                }
                headers.update(pool.headers)
                status, out, data = await generate_unary(
                    self.app, req.target.decode("latin-1"), parsed, req.body, headers
                )
                self._write(writer, status, out, data, req.keep_alive)
                return req.keep_alive
        return await self._relay(req, writer)

    def _write(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        keep: bool,
    ) -> None:
        parts = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        has_type = False
        for k, v in headers:
            has_type = has_type or k.lower() == "content-type"
            parts.append(_enc(k) + b": " + _enc(v) + b"\r\n")
        if not has_type:
            parts.append(b"Content-Type: application/json\r\n")
        parts.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self._http_date(), len(body)))
        if not keep:
            parts.append(b"Connection: close\r\n")
        parts.append(b"\r\n")
        parts.append(body)
        writer.write(b"".join(parts))

    def _http_date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    # -- relay to the aiohttp application -------------------------------------------------

    async def _relay(self, req: _Request, writer: asyncio.StreamWriter) -> bool:
        head = [req.method + b" " + req.target + b" HTTP/1.1\r\n"]
        head.extend(n + b": " + v + b"\r\n" for lower, n, v in req.headers if lower not in _REFRAME)
        head.append(b"Content-Length: %d\r\n\r\n" % len(req.body))
        request = b"".join(head) + req.body
        reader_w = self._relay_idle.pop() if self._relay_idle else None
        if reader_w is not None:
            try:
                return await self._exchange(req, writer, request, *reader_w)
            except _StaleConnection:
                pass  # aiohttp closed the idle connection: once more on a fresh one
        try:
            conn = await asyncio.open_unix_connection(self._relay_path, limit=HEAD_LIMIT)
        except OSError as exc:
            log.error("relay to the proxy's application failed: %s", exc)
            self._write(writer, 502, [], error_body(502, "proxy internal relay failed"), False)
            return False
        try:
            return await self._exchange(req, writer, request, *conn)
        except _StaleConnection:
            self._write(writer, 502, [], error_body(502, "proxy internal relay failed"), False)
            return False

    async def _exchange(
        self,
        req: _Request,
        writer: asyncio.StreamWriter,
        request: bytes,
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
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
            writer.write(b"".join(out))
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
                        writer.write(trailer)
                        break
                    writer.write(size_line + await r.readexactly(size + 2))
                    await writer.drain()
            elif length is not None:
                while length:
                    chunk = await r.read(min(length, 1 << 16))
                    if not chunk:
                        raise asyncio.IncompleteReadError(b"", length)
                    length -= len(chunk)
                    writer.write(chunk)
                    await writer.drain()
            else:
                while chunk := await r.read(1 << 16):
                    writer.write(chunk)
                    await writer.drain()
                keep_upstream = False
            reusable = keep_upstream
            return keep
        finally:
            if reusable:
                self._relay_idle.append((r, w))
            else:
                w.transport.abort()


class _StaleConnection(Exception):
    """The pooled relay connection was closed before it answered (nothing was processed)."""


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send the error, then read (and drop) what the client still sends for a moment.

    Closing a socket with unread input makes the kernel send a reset, which can destroy the
    error answer before the client reads it (a client still sending a large body or head).
    """
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    try:
        async with asyncio.timeout(2.0):
            for _ in range(64):
                if not await reader.read(1 << 16):
                    break
    except (TimeoutError, ConnectionError):
        pass


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    """The next request head without its final blank line; None when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise _HttpError(400, "connection closed inside the request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise _HttpError(431, f"request head over {HEAD_LIMIT} bytes") from None
    head = head.lstrip(b"\r\n")  # RFC 9112 2.2: ignore empty lines before a request line
    if not head:
        return await _read_head(reader)
    return head[:-4]


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    parts = []
    total = 0
    while True:
        try:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except (ValueError, asyncio.LimitOverrunError):
            raise _HttpError(400, "malformed chunked request body") from None
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        total += size
        if total > limit:
            raise _HttpError(413, f"request body too large: over {limit} bytes")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise _HttpError(400, "malformed chunked request body")


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def _enc(s: str) -> bytes:
    try:
        return s.encode("latin-1")
    except UnicodeEncodeError:
        return s.encode("utf-8", "surrogateescape")


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
        server = await asyncio.start_server(
            front.serve, config.host, config.port, backlog=1024, limit=HEAD_LIMIT
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

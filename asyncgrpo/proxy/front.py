"""The proxy's listening socket: an HTTP/1.1 server on llhttp in front of the aiohttp application.

Why: the aiohttp server costs about a quarter of a millisecond of CPU per request (request and
response objects, multidicts, URL dispatch, middlewares), more than routing and forwarding
together. So the hot path, a non-streaming ``/v1/completions`` or ``/v1/chat/completions``, is
served here by callbacks, as uvicorn's ``httptools_impl`` does: each client connection is an
:class:`asyncio.Protocol` whose ``data_received`` feeds ``httptools`` (llhttp, the parser of
Node.js and aiohttp); a request it fully accepted starts a
:class:`~asyncgrpo.proxy.unary.UnaryRequest`, and the replica connection's callback writes the
answer back. Everything else is relayed to the aiohttp application on a private unix socket
(:class:`~asyncgrpo.proxy.h1.H1Pool`) and its answer streamed back as it arrives.

No byte of framing is parsed by hand. On top of llhttp's strictness (control characters in
header values, invalid names, bad chunk sizes, duplicate Content-Length, Content-Length with
Transfer-Encoding), a request is refused when: its version is not HTTP/1.0 or 1.1 (505), it
has a transfer coding other than chunked (501), no Host or several (400), the wrong API key (401,
checked before the body is read), a body over the limit (413), a head over 64 KiB (431).
Refused means: an answer saying what was wrong, nothing forwarded, the connection closed (after
the answers to the requests pipelined before it), since its framing is in doubt.

Also: keep-alive and pipelining (answers in order; reading pauses while requests pile up),
``Expect: 100-continue``, half-closed clients (a client that shuts down its sending side still
gets its answers), idle or trickling connections closed after ``client_idle_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools
from aiohttp import web

from asyncgrpo.proxy.app import create_app
from asyncgrpo.proxy.auth import AUTH_MESSAGE, authorized, expected_header
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.h1 import Exchange, H1Pool, Response
from asyncgrpo.proxy.headers import DROP_REQUEST_B, DROP_RESPONSE_B
from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.state import CORE, error_body
from asyncgrpo.proxy.unary import UnaryRequest, request_chains

__all__ = ["HEAD_LIMIT", "Front", "serve_proxy"]

log = logging.getLogger(__name__)

#: Longest request head (request line and headers).
HEAD_LIMIT = 64 * 1024
#: Seconds a connection closed after an error keeps reading (and dropping) what the client sends.
LINGER_S = 2.0
#: Complete requests queued behind the one being answered before reading pauses.
MAX_QUEUED = 16

_GENERATE = frozenset({b"/v1/completions", b"/v1/chat/completions"})
_RELAY_DROP = DROP_REQUEST_B - {b"authorization"}  # the application checks the key too
_RELAY_ANSWER_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _HttpError(Exception):
    """The request is refused: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _parse_error(exc: httptools.HttpParserError, in_head: bool) -> _HttpError:
    """llhttp's refusal as an answer that says what was wrong."""
    if isinstance(exc.__context__, _HttpError):  # raised by one of our callbacks
        return exc.__context__
    reason = str(exc)
    low = reason.lower()
    if "content-length" in low and "transfer-encoding" in low:  # a request smuggling form
        return _HttpError(400, f"both Content-Length and Transfer-Encoding ({reason})")
    if "http version" in low:
        return _HttpError(505, f"unsupported HTTP version ({reason}): only HTTP/1.0 and 1.1")
    if not in_head:
        return _HttpError(400, f"malformed request body: {reason}")
    if "header" in low or "content-length" in low or "transfer-encoding" in low:
        return _HttpError(400, f"malformed header: {reason}")
    return _HttpError(400, f"malformed request line: {reason}")


class _Request:
    __slots__ = ("auth", "body", "expect", "headers", "hosts", "http11", "keep_alive", "method",
                 "size", "target", "te")  # fmt: skip

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []  # as llhttp accepted them
        self.hosts = 0
        self.te: list[bytes] = []
        self.auth: bytes | None = None
        self.expect: bytes | None = None
        self.http11 = True
        self.keep_alive = True
        self.body: list[bytes] = []
        self.size = 0


class Front:
    """Owns the client connections; see the module docstring. ``relay_path`` is the unix socket
    of the aiohttp application (:func:`~asyncgrpo.proxy.app.create_app`) it relays to."""

    def __init__(self, app: web.Application, relay_path: str) -> None:
        self.core = app[CORE]
        self.config = self.core.config
        self.auth = expected_header(self.config.api_key)
        self.relay = H1Pool(path=relay_path, keepalive_s=3.0)  # aiohttp's own idle timeout: 75 s
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
        for client in list(self.clients):
            client.close()
        self.relay.close()

    async def _sweep(self) -> None:
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


class _Client(asyncio.Protocol):
    """One client connection: llhttp parses its requests, which are answered in order."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.req = _Request()  # the request being parsed
        self.in_head = False
        self.head_size = 0
        self.queue: deque[_Request | _HttpError] = deque()  # parsed, waiting their turn
        self.current: _Request | None = None  # being answered
        self.started = False  # the current answer's first byte was written
        self.unary: UnaryRequest | None = None
        self.relay: _Relay | None = None
        self.eof = self.closed = self.reading_paused = self.writing_paused = False
        self.processing = False
        self.waiting_since: float | None = self.loop.time()  # None while answering

    # -- llhttp callbacks (raising _HttpError refuses the request) ------------------------------

    def on_message_begin(self) -> None:
        self.req = _Request()
        self.in_head, self.head_size = True, 0

    def on_url(self, url: bytes) -> None:
        self.req.target += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        req = self.req
        lower = name.lower()
        if lower == b"host":
            req.hosts += 1
        elif lower == b"transfer-encoding":
            req.te.append(value)
        elif lower == b"authorization":
            req.auth = value
        elif lower == b"expect":
            req.expect = value.lower()
        req.headers.append((name, value))

    def _count(self, n: int) -> None:
        self.head_size += n
        if self.head_size > HEAD_LIMIT:
            raise _HttpError(431, f"request head over {HEAD_LIMIT} bytes")

    def on_headers_complete(self) -> None:
        self.in_head = False
        req, parser, config = self.req, self.parser, self.front.config
        assert parser is not None
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise _HttpError(505, f"HTTP/{version} is not supported: only HTTP/1.0 and 1.1")
        req.method = parser.get_method()
        req.http11 = version == "1.1"
        if req.method == b"CONNECT":
            raise _HttpError(405, "CONNECT is not supported: this is not a forward proxy")
        if req.te:
            if not req.http11:
                raise _HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
            codings = [c.strip().lower() for v in req.te for c in v.split(b",")]
            if codings != [b"chunked"]:
                te = b", ".join(req.te).decode("latin-1")
                raise _HttpError(501, f"Transfer-Encoding {te!r} is not supported: only chunked")
        length = next((int(v) for n, v in req.headers if n.lower() == b"content-length"), None)
        if length is not None and length > config.max_body_bytes:
            raise _HttpError(
                413, f"request body too large: {length} bytes > {config.max_body_bytes}"
            )
        if req.hosts > 1 or (req.http11 and not req.hosts):
            raise _HttpError(400, "a request needs exactly one Host header (RFC 9112 3.2)")
        if not authorized(self.front.auth, req.auth):
            raise _HttpError(401, AUTH_MESSAGE)
        if req.expect is not None:
            if req.expect != b"100-continue":
                raise _HttpError(417, f"unsupported Expect {req.expect[:40]!r}")
            if (req.te or length) and self.current is None and not self.queue:
                self.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        req, limit = self.req, self.front.config.max_body_bytes
        req.body.append(data)
        req.size += len(data)
        if req.size > limit:  # chunked: no length said in advance
            raise _HttpError(413, f"request body too large: over {limit} bytes")

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.req.keep_alive = self.parser.should_keep_alive()
        self.queue.append(self.req)

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.front.clients.add(self)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return  # refused: lingering until the client closes
        try:
            while True:
                try:
                    self.parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:  # no protocol switch: read on as HTTP
                    data = data[exc.args[0] :]
            if self.in_head:  # llhttp buffers a header line it has not finished: bound that
                self.head_size += len(data)
                if self.head_size > HEAD_LIMIT:
                    raise _HttpError(431, f"request head over {HEAD_LIMIT} bytes")
        except httptools.HttpParserError as exc:
            self._refuse(_parse_error(exc, self.in_head))
        except _HttpError as exc:
            self._refuse(exc)
        self._process()

    def _refuse(self, exc: _HttpError) -> None:
        """Stop parsing: what follows a request llhttp refused cannot be framed."""
        self.queue.append(exc)
        self.parser = None

    def eof_received(self) -> bool:
        """The client shut down its sending side: answer what it sent, then close.

        A client that closed the whole connection looks the same until something is written
        to it, so an HTTP/1.1 request still waiting for its answer gets an interim
        ``100 Continue`` (which HTTP/1.1 clients must accept) and another shortly after: a
        gone client answers the first with a reset and the second write fails, which drops
        its request (vLLM aborts a request whose connection closes).
        """
        self.eof = True
        if self.current is None and not self.queue:
            self.close()
        elif self.current is not None and self.current.http11 and not self.started:
            self.write(_CONTINUE)
            self.loop.call_later(0.2, self._probe, self.current)
        return True

    def _probe(self, req: _Request) -> None:
        if self.current is req and not self.started:
            self.write(_CONTINUE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.front.clients.discard(self)
        self.waiting_since = None
        self._drop()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.relay is not None:
            self.relay.pause_reading(False)
        self._process()

    # -- answering, in order ------------------------------------------------------------------

    def _process(self) -> None:
        if self.processing:
            return
        self.processing = True
        try:
            while self.current is None and self.queue and not self.closed:
                if self.writing_paused:
                    return
                item = self.queue.popleft()
                if isinstance(item, _HttpError):
                    self._reject(item)
                    return
                self.current, self.started, self.waiting_since = item, False, None
                self._dispatch(item)
            if self.current is None and self.eof:
                self.close()
            if len(self.queue) > MAX_QUEUED and not self.reading_paused and self.transport:
                self.reading_paused = True
                self.transport.pause_reading()
            elif self.reading_paused and len(self.queue) <= MAX_QUEUED and self.transport:
                self.reading_paused = False
                self.transport.resume_reading()
        finally:
            self.processing = False

    def _dispatch(self, req: _Request) -> None:
        body = b"".join(req.body)
        core = self.front.core
        if req.method == b"POST" and req.target.partition(b"?")[0] in _GENERATE:
            try:
                parsed = decode_object(body, self.front.config.max_body_bytes)
            except BodyError as exc:
                core.stats.reject(exc.status)
                self._answer((exc.status, [], error_body(exc.status, str(exc))))
                return
            if parsed.get("stream") is not True:
                lines = [n + b": " + v + b"\r\n" for n, v in req.headers
                         if n.lower() not in DROP_REQUEST_B]  # fmt: skip
                lines.append(core.pool.header_lines)
                try:
                    chains = request_chains(core, parsed)
                except Exception:  # a router bug must not cost the request: route it unmatched
                    log.exception("no routing key for %r", req.target)
                    chains = []
                self.unary = UnaryRequest(
                    core, self.loop, req.target, body, chains, b"".join(lines), self._answer
                )
                self.unary.start()
                return
        lines = [n + b": " + v + b"\r\n" for n, v in req.headers if n.lower() not in _RELAY_DROP]
        self.relay = _Relay(self)
        relay = self.front.relay
        request = relay.request(req.method, req.target, b"".join(lines), body)
        relay.send(self.relay, request, head_request=req.method == b"HEAD")

    def _answer(self, answer: Response, *, done: bool = True) -> None:
        """Write a buffered answer (per-hop headers in it dropped, framing added); next."""
        self.unary = None
        req = self.current
        if req is None or self.closed:
            return
        status, headers, body = answer
        parts = [_status_line(status)]
        has_type = False
        for k, v in headers:
            lower = k.lower()
            if lower in DROP_RESPONSE_B:
                continue
            has_type = has_type or lower == b"content-type"
            parts += (k, b": ", v, b"\r\n")
        if not has_type:
            parts.append(b"Content-Type: application/json\r\n")
        parts.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self.front.http_date(), len(body)))
        if not req.keep_alive:
            parts.append(b"Connection: close\r\n")
        parts += (b"\r\n", body)
        self.write(b"".join(parts))
        if done:
            self._answered()

    def _answered(self) -> None:
        req, self.current = self.current, None
        if req is None:
            return
        if not req.keep_alive:
            self.close()
            return
        self.waiting_since = self.loop.time()
        self._process()

    def _reject(self, exc: _HttpError) -> None:
        """Answer a refused request and close, reading (and dropping) input for a moment:
        closing with unread input makes the kernel send a reset, which can destroy the error
        answer before the client reads it (a client still sending a large body or head)."""
        self.front.core.stats.reject(exc.status)
        self.parser = None
        self.queue.clear()
        self.current = _Request()
        self.current.keep_alive = False
        self._answer((exc.status, [], error_body(exc.status, str(exc))), done=False)
        self.current = None
        transport = self.transport
        if self.eof or transport is None:
            self.close()
        elif not transport.is_closing():
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(LINGER_S, self.close)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        """Close gracefully (what was written is still sent); in-flight work is dropped."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._drop()

    def _drop(self) -> None:
        unary, self.unary = self.unary, None
        if unary is not None:
            unary.cancel()
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.abort()


class _Relay(Exchange):
    """The aiohttp application's answer to one relayed request, written to the client as it
    arrives: re-chunked when it is chunked (a stream), as it is when it has a length."""

    __slots__ = ("chunked", "client")
    streams = True

    def __init__(self, client: _Client) -> None:
        super().__init__()
        self.client = client
        self.chunked = False

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        client, req = self.client, self.client.current
        assert req is not None
        out = [_status_line(status)]
        sized = req.method == b"HEAD" or status in (204, 304)
        for k, v in headers:
            lower = k.lower()
            if lower not in _RELAY_ANSWER_DROP:
                sized = sized or lower == b"content-length"
                out += (k, b": ", v, b"\r\n")
        if not sized:
            if req.http11:
                self.chunked = True
                out.append(b"Transfer-Encoding: chunked\r\n")
            else:
                req.keep_alive = False  # delimited by the close
        if not req.keep_alive:
            out.append(b"Connection: close\r\n")
        out.append(b"\r\n")
        client.started = True
        client.write(b"".join(out))

    def on_body(self, data: bytes) -> None:
        client = self.client
        client.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        if client.writing_paused:
            self.pause_reading(True)

    def on_response(self, response: Response) -> None:
        client = self.client
        client.relay = None
        if self.chunked:
            client.write(b"0\r\n\r\n")
        client._answered()

    def on_error(self, exc: OSError) -> None:
        client = self.client
        client.relay = None
        if client.started:
            client.close()  # the client has part of the answer: it sees it cut short
            return
        log.error("relay to the proxy's application failed: %s", exc)
        assert client.current is not None
        client.current.keep_alive = False
        client._answer((502, [], error_body(502, "proxy internal relay failed")))


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

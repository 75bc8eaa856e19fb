"""The proxy's listening socket: an HTTP/1.1 server on llhttp in front of the aiohttp application.

Why not aiohttp's server: it costs about a quarter of a millisecond of CPU per request, more than
routing and forwarding together. So the hot path, a non-streaming ``/v1/completions`` or
``/v1/chat/completions``, is served here by callbacks, as uvicorn's ``httptools_impl`` does: each
client connection is an :class:`asyncio.Protocol` whose ``data_received`` feeds ``httptools``
(llhttp); a request it fully accepted (and :mod:`asyncgrpo.proxy.inbound` too) starts a
:class:`~asyncgrpo.proxy.unary.UnaryRequest`. Everything else is relayed to the aiohttp
application on a private unix socket and its answer streamed back as it arrives. A refused
request gets an answer saying why, nothing is forwarded, and the connection closes (after the
answers to what was pipelined before it). Also: keep-alive and pipelining (answers in order),
``Expect: 100-continue``, half-closed clients, idle or trickling connections closed after
``client_idle_timeout_s``.
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
from functools import partial
from typing import cast

import httptools
from aiohttp import web

from asyncgrpo.proxy.app import create_app
from asyncgrpo.proxy.auth import expected_header
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.h1 import Exchange, H1Pool, Response
from asyncgrpo.proxy.headers import DROP_RESPONSE_B, head_lines
from asyncgrpo.proxy.inbound import HEAD_LIMIT, Refused, Request, check_head, refusal
from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.state import CORE, error_body
from asyncgrpo.proxy.unary import UnaryRequest, request_chains

__all__ = ["Front", "serve_proxy"]

log = logging.getLogger(__name__)

#: Seconds a connection closed after a refusal keeps reading (and dropping) what the client sends.
LINGER_S = 2.0
#: Complete requests queued behind the one being answered before reading pauses.
MAX_QUEUED = 16

_GENERATE = frozenset({b"/v1/completions", b"/v1/chat/completions"})
_RELAY_ANSWER_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Front:
    """Owns the client connections. ``relay_path``: the unix socket of the aiohttp application
    (:func:`~asyncgrpo.proxy.app.create_app`), whose pool, router and counters it shares."""

    def __init__(self, app: web.Application, relay_path: str) -> None:
        self.core = app[CORE]
        self.config = self.core.config
        self.auth = expected_header(self.config.api_key)
        self.relay = H1Pool(path=relay_path, keepalive_s=3.0)
        self.clients: set[_Client] = set()
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


class _Client(asyncio.Protocol):
    """One client connection: llhttp parses its requests, answered in order."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.req = Request()  # being parsed
        self.in_head = False
        self.head_size = 0
        self.queue: deque[Request | Refused] = deque()  # parsed, waiting their turn
        self.current: Request | None = None  # being answered
        self.started = False  # the current answer's first byte was written
        self.unary: UnaryRequest | None = None
        self.relay: _Relay | None = None
        self.eof = self.closed = self.reading_paused = self.writing_paused = False
        self.processing = False
        self.waiting_since: float | None = self.loop.time()  # None while answering

    # -- llhttp callbacks (raising Refused refuses the request) --------------------------------

    def on_message_begin(self) -> None:
        self.req, self.in_head, self.head_size = Request(), True, 0

    def on_url(self, url: bytes) -> None:
        self.req.target += url
        self._grow_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow_head(len(name) + len(value) + 4)
        self.req.headers.append((name, value))

    def _grow_head(self, n: int) -> None:
        self.head_size += n
        if self.head_size > HEAD_LIMIT:
            raise Refused(431, f"request head over {HEAD_LIMIT} bytes")

    def on_headers_complete(self) -> None:
        self.in_head = False
        req, parser = self.req, self.parser
        assert parser is not None
        req.method = parser.get_method()
        check_head(
            req, parser.get_http_version(), self.front.config.max_body_bytes, self.front.auth
        )
        if req.expect and (req.te or req.length) and self.current is None and not self.queue:
            self.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        req, limit = self.req, self.front.config.max_body_bytes
        req.body.append(data)
        req.size += len(data)
        if req.size > limit:  # chunked: no length said in advance
            raise Refused(413, f"request body too large: over {limit} bytes")

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
                except httptools.HttpParserUpgrade as exc:  # no protocol switch: read on
                    data = data[exc.args[0] :]
            if self.in_head:  # llhttp buffers a header line it has not finished: bound that
                self._grow_head(len(data))
        except httptools.HttpParserError as exc:
            self.queue.append(refusal(exc, self.in_head))
            self.parser = None  # what follows a refused request cannot be framed
        except Refused as exc:
            self.queue.append(exc)
            self.parser = None
        self._process()

    def eof_received(self) -> bool:
        """The client shut down its sending side: answer what it sent, then close.

        A client that closed the whole connection looks the same until something is written
        to it, so an HTTP/1.1 request still waiting for its answer gets an interim
        ``100 Continue`` (HTTP/1.1 clients must accept it) and another shortly after: a gone
        client answers the first with a reset and the second write fails, which drops its
        request (vLLM aborts a request whose connection closes).
        """
        self.eof = True
        if self.current is None and not self.queue:
            self.close()
        elif self.current is not None and self.current.http11 and not self.started:
            self.write(_CONTINUE)
            self.loop.call_later(0.2, self._probe, self.current)
        return True

    def _probe(self, req: Request) -> None:
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
        if self.processing:  # an answer given synchronously comes back here: no recursion
            return
        self.processing = True
        try:
            while self.current is None and self.queue and not self.closed:
                if self.writing_paused:
                    return
                item = self.queue.popleft()
                if isinstance(item, Refused):
                    self._refuse(item)
                    return
                self.current, self.started, self.waiting_since = item, False, None
                self._dispatch(item)
            if self.current is None and self.eof:
                self.close()
            elif self.transport is not None and self.reading_paused != (
                len(self.queue) > MAX_QUEUED
            ):  # a client pipelining without reading is paused
                self.reading_paused = not self.reading_paused
                if self.reading_paused:
                    self.transport.pause_reading()
                else:
                    self.transport.resume_reading()
        finally:
            self.processing = False

    def _dispatch(self, req: Request) -> None:
        body, core = b"".join(req.body), self.front.core
        if req.method == b"POST" and req.target.partition(b"?")[0] in _GENERATE:
            try:
                parsed = decode_object(body, self.front.config.max_body_bytes)
            except BodyError as exc:
                core.stats.reject(exc.status)
                self._answer((exc.status, [], error_body(exc.status, str(exc))))
                return
            if parsed.get("stream") is not True:
                lines = req.lines
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
        lines = req.lines  # the application checks the API key too
        if req.auth is not None:
            lines.append(b"Authorization: %s\r\n" % req.auth)
        self.relay = _Relay(self)
        request = self.front.relay.request(req.method, req.target, b"".join(lines), body)
        self.front.relay.send(self.relay, request, head_request=req.method == b"HEAD")

    def _answer(self, answer: Response, *, then_next: bool = True) -> None:
        """Write a buffered answer (its per-hop headers dropped, framing added)."""
        self.unary = None
        req = self.current
        if req is None or self.closed:
            return
        status, headers, body = answer
        out, typed = head_lines(status, headers, DROP_RESPONSE_B, b"content-type")
        if not typed:
            out.append(b"Content-Type: application/json\r\n")
        out.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self.front.http_date(), len(body)))
        if not req.keep_alive:
            out.append(b"Connection: close\r\n")
        out += (b"\r\n", body)
        self.write(b"".join(out))
        if then_next:
            self._answered()

    def _answered(self) -> None:
        req, self.current = self.current, None
        if req is not None and not req.keep_alive:
            self.close()
        elif req is not None:
            self.waiting_since = self.loop.time()
            self._process()

    def _refuse(self, exc: Refused) -> None:
        """Answer a refused request and close, reading (and dropping) input for a moment:
        closing with unread input makes the kernel send a reset, which can destroy the answer
        before the client reads it (a client still sending a large body or head)."""
        self.front.core.stats.reject(exc.status)
        self.parser = None
        self.queue.clear()
        self.current = Request()
        self.current.keep_alive = False
        self._answer((exc.status, [], error_body(exc.status, str(exc))), then_next=False)
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
        out, sized = head_lines(status, headers, _RELAY_ANSWER_DROP, b"content-length")
        if not (sized or req.method == b"HEAD" or status in (204, 304)):
            self.chunked = req.http11
            req.keep_alive = req.keep_alive and req.http11  # HTTP/1.0: delimited by the close
            if self.chunked:
                out.append(b"Transfer-Encoding: chunked\r\n")
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
        self.client.relay = None
        if self.chunked:
            self.client.write(b"0\r\n\r\n")
        self.client._answered()

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
        server = await asyncio.get_running_loop().create_server(
            partial(_Client, front), config.host, config.port, backlog=1024
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

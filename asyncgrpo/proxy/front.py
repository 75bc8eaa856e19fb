"""One client connection to the proxy: HTTP/1.1 parsed by llhttp (``httptools``), answered in order.

Why not aiohttp's server: its quarter millisecond of CPU per request is more than routing and
forwarding take. As in uvicorn's ``httptools_impl``, the connection is an asyncio protocol
feeding llhttp. A request that llhttp and :mod:`~asyncgrpo.proxy.inbound` accept goes to a
:class:`~asyncgrpo.proxy.unary.UnaryRequest` (non-streaming generation) or a
:class:`~asyncgrpo.proxy.relay.Relay` (the rest); a refused one gets an answer saying why,
nothing is forwarded, and the connection closes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from asyncgrpo.proxy.h1 import Response
from asyncgrpo.proxy.headers import DROP_RESPONSE_B, head_lines
from asyncgrpo.proxy.inbound import HEAD_LIMIT, TOO_LARGE, Refused, Request, check_head, refusal
from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.relay import Relay
from asyncgrpo.proxy.state import error_body
from asyncgrpo.proxy.unary import UnaryRequest

if TYPE_CHECKING:
    from asyncgrpo.proxy.server import Front

__all__ = ["Connection"]

#: Seconds a connection closed after a refusal keeps reading (and dropping) what the client sends.
LINGER_S = 2.0
#: Complete requests queued behind the one being answered before reading pauses.
MAX_QUEUED = 16

_GENERATE = frozenset({b"/v1/completions", b"/v1/chat/completions"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Connection(asyncio.Protocol):
    """One client connection; ``waiting_since`` (loop time, None while answering) lets the
    server close it when idle or trickling a request for ``client_idle_timeout_s``."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.loop = front.loop
        self.max_body = front.config.max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.req = Request()  # being parsed
        self.in_head = self.begun = False
        self.head_size = 0
        self.queue: deque[Request | Refused] = deque()  # parsed, waiting their turn
        self.current: Request | None = None  # being answered
        self.started = False  # the current answer's first byte was written
        self.work: UnaryRequest | Relay | None = None  # what answers ``current``
        self.eof = self.closed = self.reading_paused = self.writing_paused = False
        self.processing = False
        self.waiting_since: float | None = self.loop.time()

    # -- llhttp callbacks (raising Refused refuses the request) --------------------------------

    def on_message_begin(self) -> None:
        self.req = Request()
        self.in_head = self.begun = True
        self.head_size = 0

    def on_url(self, url: bytes) -> None:
        self.req.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        req, parser = self.req, cast(httptools.HttpRequestParser, self.parser)
        req.method = parser.get_method()
        check_head(req, parser.get_http_version(), self.max_body, self.front.auth)
        if req.expect and (req.te or req.length) and self.current is None and not self.queue:
            self.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        req = self.req
        req.body.append(data)
        req.size += len(data)
        if req.size > self.max_body:  # chunked: no length said in advance
            raise Refused(413, f"request body too large: over {self.max_body} bytes")

    def on_message_complete(self) -> None:
        self.req.keep_alive = cast(httptools.HttpRequestParser, self.parser).should_keep_alive()
        self.queue.append(self.req)

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        self.front.clients.add(self)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            return  # refused: lingering until the client closes
        self.begun = False
        try:
            while True:
                try:
                    parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:  # no protocol switch: read on
                    data = data[exc.args[0] :]
            # A head still unfinished (trickling) is bounded by what came since it began (one
            # begun in this piece counts from the next); a finished one by check_head.
            if self.in_head and not self.begun:
                self.head_size += len(data)
                if self.head_size > HEAD_LIMIT:
                    raise Refused(431, TOO_LARGE)
        except httptools.HttpParserError as exc:
            self.queue.append(refusal(exc, self.in_head))
            self.parser = None  # what follows a refused request cannot be framed
        except Refused as exc:
            self.queue.append(exc)
            self.parser = None
        self._process()

    def eof_received(self) -> bool:
        """The client shut down its sending side: answer what it sent, then close. A client
        gone altogether looks the same until written to: two interim ``100 Continue`` a moment
        apart make a gone client's connection fail, which drops its request."""
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
        self.closed, self.waiting_since = True, None
        self.front.clients.discard(self)
        work, self.work = self.work, None
        if work is not None:
            work.cancel()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if isinstance(self.work, Relay):
            self.work.pause_reading(False)
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
                    return self._refuse(item)
                self.current, self.started, self.waiting_since = item, False, None
                self._dispatch(item)
            pause = len(self.queue) > MAX_QUEUED  # a client pipelining without reading
            if self.current is None and self.eof:
                self.close()
            elif self.transport is not None and pause != self.reading_paused:
                self.reading_paused = pause
                (self.transport.pause_reading if pause else self.transport.resume_reading)()
        finally:
            self.processing = False

    def _dispatch(self, req: Request) -> None:
        body, core = b"".join(req.body), self.front.core
        if req.method == b"POST" and req.target.partition(b"?")[0] in _GENERATE:
            try:
                parsed = decode_object(body, self.max_body)
            except BodyError as exc:
                core.stats.reject(exc.status)
                return self.answer((exc.status, [], error_body(exc.status, str(exc))))
            if parsed.get("stream") is not True:
                req.lines.append(core.pool.header_lines)
                lines = b"".join(req.lines)
                self.work = UnaryRequest(
                    core, self.loop, req.target, body, parsed, lines, self.answer
                )
                return self.work.start()
        self.work = Relay(self)
        self.work.send(req, body)

    def _write_answer(self, answer: Response, keep_alive: bool) -> None:
        """Write a buffered answer (its per-hop headers dropped, framing added)."""
        status, headers, body = answer
        out, typed = head_lines(status, headers, DROP_RESPONSE_B, b"content-type")
        if not typed:
            out.append(b"Content-Type: application/json\r\n")
        out.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self.front.http_date(), len(body)))
        if not keep_alive:
            out.append(b"Connection: close\r\n")
        out += (b"\r\n", body)
        self.write(b"".join(out))

    def answer(self, answer: Response) -> None:
        """The whole answer to the current request, then the next one."""
        self.work = None
        if self.current is not None and not self.closed:
            self._write_answer(answer, self.current.keep_alive)
            self.answered()

    def answered(self) -> None:
        req, self.current = self.current, None
        if req is not None and not req.keep_alive:
            self.close()
        elif req is not None:
            self.waiting_since = self.loop.time()
            self._process()

    def _refuse(self, exc: Refused) -> None:
        """Answer a refused request and close after reading (and dropping) input for a moment:
        closing with unread input sends a reset, which can destroy the answer unread."""
        self.front.core.stats.reject(exc.status)
        self.parser = None
        self.queue.clear()
        self._write_answer((exc.status, [], error_body(exc.status, str(exc))), False)
        if self.eof or self.transport is None:
            self.close()
        elif not self.transport.is_closing():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.close)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        """Close gracefully (what was written is still sent); in-flight work is dropped."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.connection_lost(None)

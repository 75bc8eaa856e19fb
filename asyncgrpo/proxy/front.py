"""The proxy's one HTTP/1.1 server: client connections parsed by llhttp (``httptools``), answered
in order.

Why not aiohttp's server: its quarter millisecond of CPU per request is more than routing and
forwarding take. As in uvicorn's ``httptools_impl``, a connection is an asyncio protocol feeding
llhttp. A request that llhttp and :mod:`~asyncgrpo.proxy.http.inbound` accept goes to a
:class:`~asyncgrpo.proxy.forward.Forward` (generation, pass-through) or to a control coroutine
(:data:`~asyncgrpo.proxy.control.ROUTES`); a refused one gets an answer saying why, nothing is
forwarded, and the connection closes.

Limits: connections (:class:`Clients`), time to send a head or a body, bytes held per connection
(reading pauses) and in all (``max_buffered_bytes``); a large generation body is read in a
worker process (:mod:`~asyncgrpo.proxy.intake`): ``docs/proxy.md``, "Security".
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import cast

import httptools

from asyncgrpo.proxy.control import ROUTES
from asyncgrpo.proxy.forward import FALLBACK_BLOCK_SIZE, Forward
from asyncgrpo.proxy.http.h1 import Response
from asyncgrpo.proxy.http.headers import DROP_RESPONSE_B, RUN_HEADER, head_lines
from asyncgrpo.proxy.http.inbound import (
    HEAD_LIMIT,
    PIECE_BYTES,
    TOO_LARGE,
    Refused,
    Request,
    Rules,
    check_head,
    check_trailer,
    refusal,
)
from asyncgrpo.proxy.intake import Intake, read_generation
from asyncgrpo.proxy.runs import MAX_NAME, NAME
from asyncgrpo.proxy.state import TICK_S, Proxy, error_answer
from asyncgrpo.vllm import api

__all__ = ["Clients", "Connection"]

log = logging.getLogger(__name__)

#: Seconds a connection closed after a refusal keeps reading (and dropping) what the client sends.
LINGER_S = 2.0
#: Complete requests queued behind the one being answered before reading pauses.
MAX_QUEUED = 16
#: Longest one connection's input is parsed before the event loop serves the others: a body
#: in 1-byte chunks costs a Python call per byte (a 256 KiB read held the loop 50-250 ms).
FEED_BUDGET_S = 0.005
#: Bytes handed to llhttp at once, between two looks at the clock: a piece of body as large
#: as a joined one, so that a plain body's pieces are kept as they came, never copied.
FEED_SLICE = PIECE_BYTES

_GENERATE = frozenset(p.encode() for p in (api.COMPLETIONS_PATH, api.CHAT_COMPLETIONS_PATH))
_PASS_POST = frozenset(p.encode() for p in (api.TOKENIZE_PATH, api.DETOKENIZE_PATH))
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Clients:
    """The open client connections: their cap, their timeouts (:meth:`sweep`), and the ``Date``
    header of this second."""

    def __init__(self, proxy: Proxy, cap: int) -> None:
        cfg = proxy.config
        self.proxy, self.cap, self.rules = proxy, cap, Rules(cfg)
        self.head_s, self.idle_s = cfg.head_timeout_s, cfg.client_idle_timeout_s
        #: Ticks between two sweeps: a quarter of the shortest timeout, at most a second.
        self.every = max(1, round(min(self.head_s / 4, self.idle_s / 4, 1.0) / TICK_S))
        self.conns: set[Connection] = set()
        self._date = (0, b"")
        #: bytes of request bodies held, every connection's; at most ``max_buffered``
        self.buffered, self.max_buffered = 0, cfg.max_buffered_bytes

    def admit(self) -> bool:
        """Make room for one more connection; False if every open one is busy."""
        if len(self.conns) < self.cap:
            return True
        room = max(1, self.cap // 16)
        waiting = [c for c in self.conns if c.deadline is not None]
        for c in heapq.nsmallest(room, waiting, key=_eviction_order):
            c.close()
        if len(self.conns) >= self.cap:  # all busy: requests waiting their turn go first
            self.proxy.runs.evict(room, self.proxy.now)
        return len(self.conns) < self.cap

    def sweep(self, now: float) -> None:
        """Close connections past their deadline (see :class:`Connection`)."""
        for c in [c for c in self.conns if c.deadline is not None and c.deadline < now]:
            c.close()

    def http_date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, formatdate(now, usegmt=True).encode())
        return self._date[1]

    def close(self) -> None:
        """Close every client connection (in-flight requests are dropped)."""
        for c in list(self.conns):
            c.close()


def _eviction_order(c: Connection) -> tuple[bool, float]:
    return c.served, cast(float, c.deadline)


class Connection(asyncio.Protocol):
    """One client connection. ``deadline`` (loop time) is when it closes unless something
    happens: set while it waits for a request (head, body, or the next one), None while one of
    its requests is answered."""

    def __init__(self, clients: Clients) -> None:
        self.clients, self.proxy = clients, clients.proxy
        self.loop, self.rules = self.proxy.loop, clients.rules
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.req = Request()  # being parsed
        self.in_head = self.begun = self.in_message = False
        self.head_size = self.queued_bytes = 0
        self.held = 0  # bytes of bodies it holds, counted in ``clients.buffered``
        self.framing = self.body_calls = 0  # bytes since the last body bytes (chunk framing,
        # trailers); on_body calls
        self.queue: deque[Request | Refused] = deque()  # parsed, waiting their turn
        self.current: Request | None = None  # being answered
        self.started = self.chunked = False  # the current answer's head was written; its framing
        self.work: Forward | asyncio.Task[None] | None = None  # what answers ``current``
        self.eof = self.closed = self.reading_paused = self.writing_paused = False
        self.processing = self.served = False
        #: input read but not parsed yet (the parse budget ran out); reading pauses meanwhile
        self.backlog: memoryview | None = None
        self.deadline: float | None = self.loop.time() + clients.head_s

    # -- llhttp callbacks (raising Refused refuses the request) --------------------------------

    def on_message_begin(self) -> None:
        self.req = Request()
        self.in_head = self.begun = self.in_message = True
        self.head_size = self.framing = 0
        if self.current is None:
            self.deadline = self.proxy.now + self.clients.head_s

    def on_url(self, url: bytes) -> None:
        self.req.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:
            self.req.headers.append((name, value))
        else:  # a trailer, after the last chunk: counted against the head's limits, dropped
            check_trailer(self.req, name, value)

    def on_headers_complete(self) -> None:
        self.in_head = False
        req, parser = self.req, cast(httptools.HttpRequestParser, self.parser)
        req.method = parser.get_method()
        check_head(req, parser.get_http_version(), self.rules)
        if self.current is None:
            self.deadline = self.proxy.now + self.clients.idle_s  # for the body
            if req.expect and (req.te or req.length) and not self.queue:
                self.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        self.framing, self.body_calls = 0, self.body_calls + 1
        clients = self.clients
        if clients.buffered + len(data) > clients.max_buffered:
            raise Refused(
                503,
                f"the proxy holds max_buffered_bytes={clients.max_buffered} of "
                "request bodies: retry later",
            )
        clients.buffered += len(data)
        self.held += len(data)
        req = self.req
        req.add(data)  # small pieces (1-byte chunks) joined: it holds what it counts
        req.size += len(data)
        if req.size > self.rules.max_body:  # chunked: no length said in advance
            raise Refused(413, f"request body too large: over {self.rules.max_body} bytes")

    def on_message_complete(self) -> None:
        self.req.keep_alive = cast(httptools.HttpRequestParser, self.parser).should_keep_alive()
        self.in_message = False
        self.queued_bytes += self.req.size
        self.queue.append(self.req)

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: not a subclass
        if not self.clients.admit():
            self.parser = None
            self._write_answer(error_answer(503, "too many connections"), False, False)
            self.closed = True
            self.transport.close()
            return
        self.clients.conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return  # refused: lingering until the client closes
        if self.backlog is not None:  # read while paused (not expected): after the backlog
            self.backlog = memoryview(bytes(self.backlog) + data)
        elif len(data) <= FEED_SLICE:
            self._parse(data)
            self._process()
        else:
            self._feed(memoryview(data))

    def _feed(self, data: memoryview) -> None:
        """Parse ``data`` slice by slice for at most :data:`FEED_BUDGET_S`; what is left waits
        for the next turn of the event loop (reading paused), so that other clients are
        served between the slices of a costly input."""
        deadline = time.perf_counter() + FEED_BUDGET_S
        for start in range(0, len(data), FEED_SLICE):
            if self.parser is None:
                break
            if start and time.perf_counter() > deadline:
                self.backlog = data[start:]
                if self.transport is not None and not self.reading_paused:
                    self.reading_paused = True
                    self.transport.pause_reading()
                self.loop.call_soon(self._feed_backlog)
                break
            self._parse(data[start : start + FEED_SLICE])
        self._process()

    def _feed_backlog(self) -> None:
        data, self.backlog = self.backlog, None
        if data is None or self.closed:
            return
        if self.parser is not None:
            self._feed(data)
        else:  # refused meanwhile: read (and drop) again while lingering
            self._process()

    def _parse(self, data: bytes | memoryview) -> None:
        """Feed llhttp; a refusal (llhttp's or ours) is queued, to be answered in turn."""
        parser = cast(httptools.HttpRequestParser, self.parser)
        self.begun = False
        in_body, calls = self.in_message and not self.in_head, self.body_calls
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
            # Likewise trailers (llhttp holds a field until it ends): pieces in a body that
            # carry no body bytes.
            elif in_body and self.in_message and not self.in_head and self.body_calls == calls:
                self.framing += len(data)
                if self.framing > HEAD_LIMIT:
                    raise Refused(431, TOO_LARGE + " (trailers included)")
        except httptools.HttpParserError as exc:
            self.queue.append(refusal(exc, self.in_head))
            self.parser = None  # what follows a refused request cannot be framed
        except Refused as exc:
            self.queue.append(exc)
            self.parser = None

    def eof_received(self) -> bool:
        """The client shut down its sending side: answer what it sent, then close. A client
        gone altogether looks the same until written to: two interim ``100 Continue`` a moment
        apart make a gone client's connection fail, which drops its request."""
        self.eof = True
        if self.current is None and not self.queue and self.backlog is None:
            self.close()
        elif self.current is not None and self.current.http11 and not self.started:
            self.write(_CONTINUE)
            self.loop.call_later(0.2, self._probe, self.current)
        return True

    def _probe(self, req: Request) -> None:
        if self.current is req and not self.started:
            self.write(_CONTINUE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed, self.deadline, self.backlog = True, None, None
        self.clients.conns.discard(self)
        self.clients.buffered -= self.held
        self.held = 0
        work, self.work = self.work, None
        if isinstance(work, Forward):
            work.cancel()  # a control call runs to its end: a broadcast is all or nothing

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        if isinstance(self.work, Forward):
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
                self.queued_bytes -= item.size
                self.current, self.started, self.deadline = item, False, None
                self._dispatch(item)
            # A client pipelining without reading: bounded in number and in bytes.
            partial = self.req.size if self.in_message else 0
            pause = self.backlog is not None or (
                (self.current is not None or bool(self.queue))
                and (
                    len(self.queue) > MAX_QUEUED
                    or self.queued_bytes + partial >= self.rules.max_body
                )
            )
            if self.current is None and self.eof and self.backlog is None:
                self.close()
            elif self.transport is not None and pause != self.reading_paused:
                self.reading_paused = pause
                (self.transport.pause_reading if pause else self.transport.resume_reading)()
        finally:
            self.processing = False

    def _dispatch(self, req: Request) -> None:
        proxy = self.proxy
        method, path = req.method, req.target.partition(b"?")[0]
        if method == b"POST" and path in _GENERATE:
            block_size = None
            if proxy.router.policy.reads_prompt:
                block_size = proxy.pool.block_size or FALLBACK_BLOCK_SIZE
            if req.size > proxy.config.offload_body_bytes:  # off the event loop, unjoined
                forward = (method, req.target, b"".join(req.lines), req.body)
                read = proxy.offload.read(req.body, self.rules.max_body, block_size)
                self.work = proxy.spawn(self._offloaded(req, forward, read), "asyncgrpo-read")
                return
            body = b"".join(req.body)
            forward = (method, req.target, b"".join(req.lines), body)
            return self._generate(
                req, forward, read_generation(body, self.rules.max_body, block_size)
            )
        body = b"".join(req.body)
        forward = (method, req.target, b"".join(req.lines), body)
        if (handler := ROUTES.get((b"GET" if method == b"HEAD" else method, path))) is not None:
            self.work = proxy.spawn(self._control(handler, req, body), f"asyncgrpo-proxy {path!r}")
            return
        elif method in (b"GET", b"HEAD") or (method == b"POST" and path in _PASS_POST):
            self.work = Forward(proxy, self, forward, None)
        else:
            what = f"{method.decode()} {path.decode('latin-1')}"
            return self.answer(
                error_answer(
                    404,
                    f"{what} is not proxied: only GET, generation, tokenize and the broadcast "
                    "control calls are",
                )
            )
        self.work.start()

    def _generate(
        self,
        req: Request,
        forward: tuple[bytes, bytes, bytes, bytes | list[bytes | bytearray]],
        intake: Intake,
    ) -> None:
        """Relay a generation request (or answer why not) once its body is read."""
        proxy = self.proxy
        if intake.status:
            proxy.stats.rejected[intake.status] += 1
            return self.answer(error_answer(intake.status, intake.message))
        if req.run is not None and not NAME.fullmatch(req.run):
            proxy.stats.rejected[400] += 1
            return self.answer(
                error_answer(
                    400,
                    f"{RUN_HEADER} must be 1 to {MAX_NAME} "
                    "printable ASCII characters without spaces",
                )
            )
        proxy.stats.route_seconds += intake.hash_s
        run = proxy.runs.run(intake.model, proxy.now, named=req.run)
        self.work = Forward(
            proxy,
            self,
            forward,
            intake.chains,
            stream=intake.stream,
            run=run,
            cost=intake.cost,
            session=req.session,
        )
        self.work.submit()  # now, or its run's turn while the replicas are saturated

    async def _offloaded(
        self,
        req: Request,
        forward: tuple[bytes, bytes, bytes, bytes | list[bytes | bytearray]],
        read: Awaitable[Intake],
    ) -> None:
        intake = await read
        if self.current is req and not self.closed:
            self._generate(req, forward, intake)

    async def _control(
        self,
        handler: Callable[[Proxy, str, str, bytes], Awaitable[Response]],
        req: Request,
        body: bytes,
    ) -> None:
        method = "GET" if req.method == b"HEAD" else req.method.decode()
        try:
            answer = await handler(self.proxy, method, req.target.decode("latin-1"), body)
        except Exception:
            log.exception("%s %r failed", method, req.target)
            answer = error_answer(500, "the proxy failed on this request: see its log")
        if self.current is req:
            self.answer(answer)

    def _write_answer(self, answer: Response, keep_alive: bool, head: bool) -> None:
        """Write a buffered answer (its per-hop headers dropped, framing added)."""
        status, headers, body = answer
        out, typed = head_lines(status, headers, DROP_RESPONSE_B, b"content-type")
        if not typed:
            out.append(b"Content-Type: application/json\r\n")
        out.append(b"Date: %s\r\nContent-Length: %d\r\n" % (self.clients.http_date(), len(body)))
        if not keep_alive:
            out.append(b"Connection: close\r\n")
        out += (b"\r\n", b"" if head else body)
        self.write(b"".join(out))

    def answer(self, answer: Response) -> None:
        """The whole answer to the current request, then the next one."""
        self.work = None
        req = self.current
        if req is not None and not self.closed:
            self._write_answer(answer, req.keep_alive, req.method == b"HEAD")
            self.answered()

    def stream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Start a streamed answer: chunked, or delimited by the close for HTTP/1.0."""
        req = cast(Request, self.current)
        out, _ = head_lines(status, headers, DROP_RESPONSE_B, b"")
        out.append(b"Date: %s\r\n" % self.clients.http_date())
        self.chunked = req.http11
        if self.chunked:
            out.append(b"Transfer-Encoding: chunked\r\n")
        req.keep_alive = req.keep_alive and req.http11
        if not req.keep_alive:
            out.append(b"Connection: close\r\n")
        out.append(b"\r\n")
        self.started = True
        self.write(b"".join(out))

    def stream_body(self, data: bytes) -> None:
        self.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)

    def stream_end(self) -> None:
        self.work = None
        if self.chunked:
            self.write(b"0\r\n\r\n")
        self.answered()

    def answered(self) -> None:
        req, self.current = self.current, None
        if req is not None:
            freed = min(req.size, self.held)
            self.held -= freed
            self.clients.buffered -= freed
        if req is not None and not req.keep_alive:
            self.close()
        elif req is not None:
            self.served = True
            wait = self.clients.head_s if self.in_head else self.clients.idle_s
            self.deadline = self.proxy.now + wait
            self._process()

    def _refuse(self, exc: Refused) -> None:
        """Answer a refused request and close after reading (and dropping) input for a moment:
        closing with unread input sends a reset, which can destroy the answer unread."""
        self.proxy.stats.rejected[exc.status] += 1
        self.parser = None
        self.queue.clear()
        self._write_answer(error_answer(exc.status, str(exc)), False, False)
        if self.eof or self.transport is None:
            self.close()
        elif not self.transport.is_closing():
            self.transport.write_eof()
            self.deadline = self.loop.time() + LINGER_S
            if self.reading_paused:  # lingering reads (and drops) whatever comes
                self.reading_paused = False
                self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        """Close gracefully (what was written is still sent); in-flight work is dropped."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self.connection_lost(None)

"""The proxy's aiohttp application answering one client request, relayed as the answer arrives.

Everything the front does not serve itself (streams, control calls, metrics) goes to the
application over a unix socket; this writes its answer to the client as it comes: re-chunked when
it is chunked (a stream), as it is when it has a length, cut short if the application fails after
the first byte.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from asyncgrpo.proxy.h1 import Exchange, Response
from asyncgrpo.proxy.headers import head_lines
from asyncgrpo.proxy.inbound import Request
from asyncgrpo.proxy.state import error_body

if TYPE_CHECKING:
    from asyncgrpo.proxy.front import Connection

__all__ = ["Relay"]

log = logging.getLogger(__name__)

_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})


class Relay(Exchange):
    """The application's answer to the request ``client`` is answering."""

    __slots__ = ("chunked", "client")
    streams = True

    def __init__(self, client: Connection) -> None:
        super().__init__()
        self.client = client
        self.chunked = False

    cancel = Exchange.abort  # the client went away

    def send(self, req: Request, body: bytes) -> None:
        """Send ``req`` (with ``body``) to the application."""
        if req.auth is not None:  # the application checks the API key too
            req.lines.append(b"Authorization: %s\r\n" % req.auth)
        pool = self.client.front.relay
        request = pool.request(req.method, req.target, b"".join(req.lines), body)
        pool.send(self, request, head_request=req.method == b"HEAD")

    def pause_reading(self, paused: bool) -> None:
        """Back-pressure: stop (or resume) reading the answer while the client cannot keep up."""
        t = self.conn.transport if self.conn is not None else None
        if t is not None and not t.is_closing():
            (t.pause_reading if paused else t.resume_reading)()

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        client, req = self.client, self.client.current
        assert req is not None
        out, sized = head_lines(status, headers, _DROP, b"content-length")
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
        self.client.work = None
        if self.chunked:
            self.client.write(b"0\r\n\r\n")
        self.client.answered()

    def on_error(self, exc: OSError) -> None:
        client = self.client
        client.work = None
        if client.started:
            client.close()  # the client has part of the answer: it sees it cut short
            return
        log.error("relay to the proxy's application failed: %s", exc)
        assert client.current is not None
        client.current.keep_alive = False
        client.answer((502, [], error_body(502, "proxy internal relay failed")))

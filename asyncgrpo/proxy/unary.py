"""One buffered (non-streaming) generation request, driven by callbacks: route, forward, retry.

Why callbacks: at one request in flight every Python step between the client's bytes and the
replica's socket is added latency. :class:`UnaryRequest` runs from the front's ``data_received``
to the replica connection's ``data_received`` and back without a task or a future (the
connection is an :class:`asyncio.Protocol`, :mod:`asyncgrpo.proxy.h1`); ``https`` replicas go
through aiohttp in a task. Routing, outcomes and retries are :class:`~asyncgrpo.proxy.attempts.
Attempts`, shared with the streaming path; each attempt runs under ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from asyncgrpo.proxy.attempts import Attempts, request_chains
from asyncgrpo.proxy.deadlines import Expiring
from asyncgrpo.proxy.h1 import Exchange, Response
from asyncgrpo.proxy.headers import REPLICA_HEADER_B
from asyncgrpo.proxy.state import Core
from asyncgrpo.proxy.upstream import Upstream

__all__ = ["UnaryRequest", "forward_unary"]

log = logging.getLogger(__name__)


class UnaryRequest(Exchange):
    """Route and forward one buffered generation request; ``on_answer`` is called exactly once
    (unless :meth:`cancel` is called first) with (status, headers, body): the replica's headers
    as it sent them plus :data:`~asyncgrpo.proxy.headers.REPLICA_HEADER`; whoever writes the
    answer drops the per-hop ones (``DROP_RESPONSE``) as it renders them.

    Each attempt's deadline is in ``core.deadlines`` (one timer for all requests); while it runs
    the request also sits in its replica's ``deadlines`` (``expired`` and ``reschedule``, like
    :class:`asyncio.Timeout`), so a replica leaving rotation can end it now.
    """

    __slots__ = ("attempts", "body", "core", "headers", "loop", "on_answer", "path", "slot",
                 "task", "timer")  # fmt: skip

    def __init__(
        self,
        core: Core,
        loop: asyncio.AbstractEventLoop,
        path_qs: bytes,
        body: bytes,
        parsed: dict[str, Any],
        header_lines: bytes,
        on_answer: Callable[[Response], None],
    ) -> None:
        super().__init__()
        self.core = core
        self.path = path_qs
        self.body = body
        self.headers = header_lines  # forwarded as they are; the pool adds Host, Content-Length
        self.on_answer: Callable[[Response], None] | None = on_answer
        self.loop = loop
        self.attempts = Attempts(core, request_chains(core, parsed), path_qs.decode("latin-1"))
        self.slot: set[Expiring] | None = None  # in core.deadlines
        self.timer: asyncio.TimerHandle | None = None  # a deadline rescheduled
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        up = self.attempts.next()
        if up is None:
            self._answer(self.attempts.exhausted())
            return
        if up.h1 is not None:
            up.h1.send(self, up.h1.request(b"POST", self.path, self.headers, self.body))
        else:
            self.task = self.loop.create_task(self._via_aiohttp(up))
        when = self.loop.time() + self.core.config.request_timeout_s
        self.slot = self.core.deadlines.add(self, when)
        up.deadlines.add(self)

    def cancel(self) -> None:
        """The client went away or the proxy stops: drop the attempt, answer nothing."""
        self.on_answer = None
        self._end(None)

    def _end(self, outcome: int | BaseException | None, detail: str = "") -> bool:
        """End the attempt in progress (see :meth:`Attempts.done`); True: try another."""
        self._clear_deadline()
        if outcome is None or isinstance(outcome, TimeoutError):
            self.abort()  # the raw connection, if any
            if self.task is not None:
                self.task.cancel()
        self.task = None
        up = self.attempts.up
        if up is not None:
            up.deadlines.discard(self)
        return self.attempts.done(outcome, detail)

    def _answer(self, answer: Response) -> None:
        on_answer, self.on_answer = self.on_answer, None
        if on_answer is not None:
            on_answer(answer)

    # -- outcomes (h1.Exchange) -----------------------------------------------------------------

    def on_response(self, response: Response) -> None:
        status, headers, data = response
        up = self.attempts.up
        assert up is not None
        if status >= 500:
            # The replica failed (vLLM answers 500 EngineDeadError while it shuts down): out of
            # rotation, and the request, which has no side effects, goes elsewhere.
            self._end(status, data[:200].decode(errors="replace"))
            self.start()
            return
        headers.append((REPLICA_HEADER_B, up.url_b))
        self._answer(response)  # the client first; the bookkeeping can wait
        self._end(status)

    def on_error(self, exc: OSError) -> None:
        self._end(exc)
        self.start()

    def _clear_deadline(self) -> None:
        if self.slot is not None:
            self.slot.discard(self)
            self.slot = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def on_deadline(self) -> None:
        self.slot = self.timer = None
        self._end(TimeoutError(f"no answer within the deadline on {self.path.decode('latin-1')}"))
        self.start()

    # -- the replica's deadline handle (Upstream.expire_inflight) -----------------------------

    def expired(self) -> bool:
        return self.slot is None and self.timer is None

    def reschedule(self, when: float | None) -> None:
        if self.expired():
            return
        self._clear_deadline()
        self.timer = None if when is None else self.loop.call_at(when, self.on_deadline)

    # -- replicas the raw pool cannot reach (https, a path prefix) ------------------------------

    async def _via_aiohttp(self, up: Upstream) -> None:
        headers = dict(
            line.decode("latin-1").split(": ", 1) for line in self.headers.split(b"\r\n") if line
        )
        url = up.url + self.path.decode("latin-1")
        try:
            async with self.core.pool.session.post(url, data=self.body, headers=headers) as r:
                response = (r.status, list(r.raw_headers), await r.read())
        except (aiohttp.ClientError, OSError) as exc:  # TimeoutError included
            self.on_error(exc if isinstance(exc, OSError) else OSError(str(exc)))
            return
        except Exception as exc:  # never leave the request waiting for its deadline
            log.exception("forwarding to %s failed", up.url)
            self.on_error(OSError(f"{type(exc).__name__}: {exc}"))
            return
        self.on_response(response)


async def forward_unary(
    core: Core, path_qs: str, parsed: dict[str, Any], body: bytes, headers: dict[str, str]
) -> Response:
    """:class:`UnaryRequest` as a coroutine (the aiohttp handler's way in)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Response] = loop.create_future()

    def on_answer(answer: Response) -> None:
        if not fut.done():  # not cancelled meanwhile (the client went away)
            fut.set_result(answer)

    lines = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items())
    request = UnaryRequest(core, loop, path_qs.encode("latin-1"), body, parsed, lines, on_answer)
    request.start()
    try:
        return await fut
    finally:
        if not fut.done() or fut.cancelled():
            request.cancel()

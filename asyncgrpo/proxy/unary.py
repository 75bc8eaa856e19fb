"""One buffered (non-streaming) generation request, driven by callbacks: route, forward, retry.

Why callbacks: at one request in flight every Python step between the client's bytes and the
replica's socket is added latency. :class:`UnaryRequest` runs from the front's ``data_received``
to the replica connection's ``data_received`` and back without a task or a future (the
connection is an :class:`asyncio.Protocol`, :mod:`asyncgrpo.proxy.h1`); ``https`` replicas go
through aiohttp in a task.

Each attempt: the router picks a replica (not one already tried), the request is sent on it under
``request_timeout_s``. A refused connect, a broken connection, the deadline or a 5xx answer counts
against the replica (its circuit: :mod:`asyncgrpo.proxy.upstream`), withdraws the attempt's
routing claims, and the request goes to another replica (a completion has no side effects) up to
``max_attempts``; then the answer is a 503 naming the last error. Any other answer, 4xx included,
is the client's. Every upstream failure is mapped to a status here, in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy.h1 import ConnectFailed, Disconnected, Exchange, Response
from asyncgrpo.proxy.headers import REPLICA_HEADER_B
from asyncgrpo.proxy.router import Decision, request_hashes
from asyncgrpo.proxy.state import Core, error_body
from asyncgrpo.proxy.upstream import Upstream

__all__ = ["FALLBACK_BLOCK_SIZE", "UnaryRequest", "forward_unary", "request_chains"]

log = logging.getLogger(__name__)

#: Block size used for hashing until the replicas' /server_info has been read.
FALLBACK_BLOCK_SIZE = 16

_JSON = [(b"Content-Type", b"application/json")]


def request_chains(core: Core, parsed: dict[str, Any]) -> list[tuple[int, ...]]:
    """The routing key of a parsed generation request (empty when routing ignores prefixes)."""
    if core.router.policy != "affinity":
        return []
    t0 = time.perf_counter()
    chains = request_hashes(parsed, core.pool.block_size or FALLBACK_BLOCK_SIZE)
    core.stats.route_seconds += time.perf_counter() - t0
    return chains


class UnaryRequest(Exchange):
    """Route and forward one buffered generation request; ``on_answer`` is called exactly once
    (unless :meth:`cancel` is called first) with (status, headers, body): the replica's headers
    as it sent them plus :data:`~asyncgrpo.proxy.headers.REPLICA_HEADER`; whoever writes the
    answer drops the per-hop ones (``DROP_RESPONSE``) as it renders them.

    While an attempt runs the request sits in its replica's ``deadlines`` (``expired`` and
    ``reschedule``, like :class:`asyncio.Timeout`), so a replica leaving rotation can end it now.
    """

    __slots__ = (
        "body",
        "chains",
        "core",
        "decision",
        "headers",
        "last_error",
        "loop",
        "on_answer",
        "path",
        "task",
        "timer",
        "tried",
        "up",
    )

    def __init__(
        self,
        core: Core,
        loop: asyncio.AbstractEventLoop,
        path_qs: bytes,
        body: bytes,
        chains: list[tuple[int, ...]],
        header_lines: bytes,
        on_answer: Callable[[Response], None],
    ) -> None:
        super().__init__()
        self.core = core
        self.path = path_qs
        self.body = body
        self.chains = chains
        self.headers = header_lines  # forwarded as they are; the pool adds Host, Content-Length
        self.on_answer: Callable[[Response], None] | None = on_answer
        self.loop = loop
        self.tried: list[str] = []
        self.last_error = ""
        self.up: Upstream | None = None
        self.decision: Decision | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._attempt()

    def cancel(self) -> None:
        """The client went away or the proxy stops: drop the attempt, answer nothing."""
        self.on_answer = None
        if self.up is not None:
            self._drop_transfer()
            self._end_attempt(ok=False)

    # -- attempts -----------------------------------------------------------------------------

    def _attempt(self) -> None:
        core = self.core
        config, router, pool = core.config, core.router, core.pool
        if len(self.tried) >= config.max_attempts:
            self._exhausted()
            return
        t0 = time.perf_counter()
        try:
            decision = router.route(self.chains, exclude=self.tried)
        except NoHealthyReplica:
            self._exhausted()
            return
        up = pool.upstreams[decision.replica]
        self.up, self.decision = up, decision
        self.tried.append(up.url)
        if up.h1 is not None:
            up.h1.send(self, up.h1.request(b"POST", self.path, self.headers, self.body))
        else:
            self.task = self.loop.create_task(self._via_aiohttp(up))
        # Bookkeeping once the request is on its way: it overlaps with the replica's work.
        core.stats.route_seconds += time.perf_counter() - t0
        core.stats.route_count += 1
        pool.on_routed(up)
        loop = self.loop
        self.timer = loop.call_at(loop.time() + config.request_timeout_s, self._on_deadline)
        up.deadlines.add(self)

    def _end_attempt(self, *, ok: bool) -> Upstream:
        up, decision = self.up, self.decision
        assert up is not None and decision is not None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        up.deadlines.discard(self)
        self.up = self.decision = None
        self.core.router.finish(decision, ok=ok)
        return up

    def _drop_transfer(self) -> None:
        self.abort()  # the raw connection, if any
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def _retry(self, reason: str) -> None:
        self.last_error = reason
        if len(self.tried) < self.core.config.max_attempts:
            self.core.stats.retries += 1
            log.info("retrying %s elsewhere after %s", self.path.decode("latin-1"), reason)
        self._attempt()

    def _exhausted(self) -> None:
        self.core.stats.reject(503)
        message = (
            f"no replica could serve the request (tried {len(self.tried)}): "
            f"{self.last_error or 'none in rotation'}"
        )
        self._answer((503, list(_JSON), error_body(503, message, kind="ServiceUnavailableError")))

    def _answer(self, answer: Response) -> None:
        on_answer, self.on_answer = self.on_answer, None
        if on_answer is not None:
            on_answer(answer)

    # -- outcomes (h1.Exchange) -----------------------------------------------------------------

    def on_response(self, response: Response) -> None:
        status, headers, data = response
        self.task = None
        up = self.up
        assert up is not None
        if status >= 500:
            # The replica failed (vLLM answers 500 EngineDeadError while it shuts down): out of
            # rotation, and the request, which has no side effects, goes elsewhere.
            self._end_attempt(ok=False)
            self.core.pool.on_failure(up, f"http_{status}", data[:200].decode(errors="replace"))
            self._retry(f"{up.url} answered {status}")
            return
        headers.append((REPLICA_HEADER_B, up.url_b))
        self._answer(response)  # the client first; the bookkeeping can wait
        self._end_attempt(ok=200 <= status < 300)
        self.core.pool.on_success(up)

    def on_error(self, exc: OSError) -> None:
        self.task = None
        up = self._end_attempt(ok=False)
        pool = self.core.pool
        if isinstance(exc, ConnectFailed):
            pool.on_failure(up, "connect", str(exc))
            self._retry(f"{up.url}: cannot connect")
        elif isinstance(exc, TimeoutError):
            pool.on_failure(up, "deadline", str(exc))
            self._retry(f"{up.url}: connect timed out")
        else:
            # A dropped connection: a crashed replica (its next connect is refused and trips the
            # circuit) or a keep-alive race; either way the request is retried.
            pool.on_failure(up, "disconnect", f"{type(exc).__name__}: {exc}", trip=False)
            self._retry(f"{up.url}: {type(exc).__name__}")

    def _on_deadline(self) -> None:
        self.timer = None
        self._drop_transfer()
        up = self._end_attempt(ok=False)
        path = self.path.decode("latin-1")
        self.core.pool.on_failure(up, "deadline", f"no answer within the deadline on {path}")
        self._retry(f"{up.url} hit the deadline")

    # -- the replica's deadline handle (Upstream.expire_inflight) -----------------------------

    def expired(self) -> bool:
        return self.timer is None

    def reschedule(self, when: float | None) -> None:
        if self.timer is None:
            return
        self.timer.cancel()
        self.timer = None if when is None else self.loop.call_at(when, self._on_deadline)

    # -- replicas the raw pool cannot reach (https, a path prefix) ------------------------------

    async def _via_aiohttp(self, up: Upstream) -> None:
        headers = dict(
            line.decode("latin-1").split(": ", 1) for line in self.headers.split(b"\r\n") if line
        )
        url = up.url + self.path.decode("latin-1")
        try:
            async with self.core.pool.session.post(url, data=self.body, headers=headers) as r:
                response = (r.status, list(r.raw_headers), await r.read())
        except aiohttp.ClientConnectorError as exc:
            self.on_error(ConnectFailed(str(exc)))
            return
        except TimeoutError as exc:
            self.on_error(TimeoutError(f"{type(exc).__name__}: {exc}"))
            return
        except (aiohttp.ClientError, OSError) as exc:
            self.on_error(Disconnected(f"{type(exc).__name__}: {exc}"))
            return
        except Exception as exc:  # never leave the request waiting for its deadline
            log.exception("forwarding to %s failed", up.url)
            self.on_error(Disconnected(f"{type(exc).__name__}: {exc}"))
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
    chains = request_chains(core, parsed)
    request = UnaryRequest(core, loop, path_qs.encode("latin-1"), body, chains, lines, on_answer)
    request.start()
    try:
        return await fut
    finally:
        if not fut.done() or fut.cancelled():
            request.cancel()

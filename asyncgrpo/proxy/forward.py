"""One client request relayed to one replica at a time: route, send, retry elsewhere, answer.

Buffered and streamed generation requests and pass-through calls (``/tokenize``, a GET) are each a
:class:`Forward`, driven by callbacks from the client connection to the replica connection and
back, without a task or a future: at one request in flight every Python step is added latency.
A failed try (refused or dropped connection, 5xx for generation, missed deadline) withdraws its
routing claims, counts against the replica (:func:`~asyncgrpo.proxy.upstream.failure_kind`) and
goes to another replica while the client has received nothing, up to ``max_attempts``; then a
503 names the last error. A stream's head waits for its first chunk, so that stays retryable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy.http.h1 import Exchange, Response
from asyncgrpo.proxy.http.headers import REPLICA_HEADER_B
from asyncgrpo.proxy.router import Decision
from asyncgrpo.proxy.runs import Run
from asyncgrpo.proxy.state import Proxy, error_answer
from asyncgrpo.proxy.upstream import Upstream

__all__ = ["FALLBACK_BLOCK_SIZE", "Client", "Forward"]

log = logging.getLogger(__name__)

#: Block size used for hashing until the replicas' /server_info has been read.
FALLBACK_BLOCK_SIZE = 16


class Client(Protocol):
    """The client connection a :class:`Forward` answers."""

    writing_paused: bool

    def answer(self, response: Response) -> None: ...

    def stream_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def stream_body(self, data: bytes) -> None: ...

    def stream_end(self) -> None: ...

    def close(self) -> None: ...


class Forward(Exchange):
    """Relay one request; the client gets exactly one answer (or a stream) unless
    :meth:`cancel` comes first. ``chains`` None: not a generation request (round-robin, not
    counted in flight, the replica's answer is the answer whatever its status). While a try runs
    the request is in ``proxy.inflight`` (its deadline ``due`` checked every tick) and in its
    replica's ``inflight``, so a replica leaving rotation can end it at the next tick. A
    generation request belongs to a ``run`` (:mod:`~asyncgrpo.proxy.runs`) and holds ``cost``
    sequences of its share from :meth:`submit` (or its turn) to its answer; ``session`` is the
    hash of its ``X-Session-ID``, if it has one."""

    __slots__ = (
        "began",
        "body",
        "chains",
        "client",
        "cost",
        "decision",
        "due",
        "head",
        "held",
        "last_error",
        "lines",
        "method",
        "path",
        "proxy",
        "run",
        "sent",
        "session",
        "started",
        "streams",
        "timeout",
        "tried",
        "up",
    )

    def __init__(
        self,
        proxy: Proxy,
        client: Client,
        req: tuple[bytes, bytes, bytes, bytes | list[bytes | bytearray]],
        chains: Sequence[tuple[int, ...]] | None,
        *,
        stream: bool = False,
        run: Run | None = None,
        cost: int = 0,
        session: int | None = None,
    ) -> None:
        super().__init__()
        self.proxy, self.chains, self.session = proxy, chains, session
        self.client: Client | None = client
        # The client's header lines are forwarded as they are; the pool adds Host, auth, length.
        self.method, self.path, self.lines, self.body = req
        self.streams, self.started = stream, False
        cfg = proxy.config
        self.timeout = cfg.request_timeout_s if chains is not None else cfg.broadcast_timeout_s
        self.head: list[tuple[bytes, bytes]] = []
        self.tried: list[str] = []
        self.last_error = ""
        self.up: Upstream | None = None  # of the try in progress
        self.decision: Decision | None = None
        self.due = 0.0
        self.sent = 0.0  # when the try in progress went out (the tick's coarse clock)
        self.run, self.cost = run, cost
        self.held, self.began = False, 0.0  # holds its sequences of the run's share; since

    def submit(self) -> None:
        """Send it now, or (replicas saturated) when its run's turn comes."""
        proxy, run = self.proxy, self.run
        if run is not None and proxy.runs.queue_full(run):
            self.run = None
            proxy.stats.rejected[429] += 1
            return self._answer(
                error_answer(
                    429,
                    f"run {run.name} has max_queued_per_run={proxy.runs.max_queued} requests "
                    "waiting for its turn (the replicas are saturated): retry later",
                )
            )
        if run is None or proxy.runs.admit(run, self, self.cost, proxy.now):
            self.held, self.began = run is not None, proxy.now
            self.start()

    def admitted(self) -> None:
        """Its turn: it holds its sequences until it is answered."""
        self.held, self.began = True, self.proxy.now
        self.start()

    def dropped(self, status: int, message: str, *, close: bool) -> None:
        """Taken out of its run's queue unsent (:meth:`Runs.expire_waiting`, :meth:`Runs.evict`):
        answer ``status``; ``close``: its connection too."""
        self.run = None
        self.proxy.stats.rejected[status] += 1
        client = self.client
        self._answer(error_answer(status, message))
        if close and client is not None:
            client.close()

    def _release(self) -> None:
        """Answered, or its client is gone: its sequences go to the next request waiting."""
        run, self.run = self.run, None
        if run is None:
            return
        runs, now = self.proxy.runs, self.proxy.now
        if not self.held:
            return runs.withdraw(run, self)
        runs.done(run, self.cost, now - self.began)
        if runs.waiting:
            runs.pump(now)

    def start(self) -> None:
        """Send the next try to a replica not tried yet, or answer 503 naming the last error."""
        proxy = self.proxy
        up = None
        if len(self.tried) < proxy.config.max_attempts:
            t0 = time.perf_counter()
            try:
                if self.chains is None:
                    up = proxy.pool.upstreams[proxy.router.pick(exclude=self.tried)]
                else:
                    self.decision = proxy.router.route(
                        self.chains, exclude=self.tried, session=self.session
                    )
                    up = proxy.pool.upstreams[self.decision.replica]
                    proxy.stats.route_seconds += time.perf_counter() - t0
                    proxy.stats.route_count += 1
                    proxy.pool.on_routed(up)
            except NoHealthyReplica:
                pass
        if up is None:
            proxy.stats.rejected[503] += 1
            message = (
                f"no replica could serve the request (tried {len(self.tried)}): "
                f"{self.last_error or 'none in rotation'}"
            )
            self._answer(error_answer(503, message))
            return self._release()
        self.up = up
        self.tried.append(up.url)
        up.h1.send(
            self,
            up.h1.request(self.method, self.path, self.lines, self.body),
            head_request=self.method == b"HEAD",
        )
        self.sent = proxy.now
        self.due = proxy.loop.time() + self.timeout
        proxy.inflight.add(self)
        up.inflight.add(self)

    def cancel(self) -> None:
        """The client went away or the proxy stops: drop the try, answer nothing."""
        self.client = None
        self._end(None)
        self._release()

    def _end(self, outcome: int | BaseException | None, detail: str = "") -> bool:
        """End the try in progress with ``outcome`` (a status, what it raised, or None: the
        client went away); True if it failed and the request may try elsewhere."""
        up, decision, proxy = self.up, self.decision, self.proxy
        proxy.inflight.discard(self)
        if outcome is None or isinstance(outcome, TimeoutError):
            self.abort()  # the replica connection, if any
        if up is None:
            return False
        up.inflight.discard(self)
        self.up = self.decision = None
        if outcome is None or (decision is None and isinstance(outcome, int)):
            if decision is not None:
                proxy.router.finish(decision, ok=False)
            return False
        failed = proxy.pool.on_outcome(up, outcome, detail)
        if decision is not None:
            ok = not failed and isinstance(outcome, int) and outcome < 300
            proxy.router.finish(decision, ok=ok)
        if failed:
            proxy.stats.lost_requests += 1
            proxy.stats.lost_seconds += max(proxy.now - self.sent, 0.0)
            reason = outcome if isinstance(outcome, int) else type(outcome).__name__
            self.last_error = f"{up.url}: {reason}" + (f" ({detail[:200]})" if detail else "")
            if len(self.tried) < proxy.config.max_attempts:
                proxy.stats.retries += 1
                log.info("retrying %s elsewhere after %s", self.path, self.last_error)
        return failed

    def _answer(self, answer: Response) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.answer(answer)

    def _fail(self, exc: OSError) -> None:
        self._end(exc)
        if not self.started:
            return self.start()
        client, self.client = self.client, None
        if client is not None:
            client.close()  # the client has part of the answer: it sees it cut short
        self._release()

    # -- outcomes (h1.Exchange) -----------------------------------------------------------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        if status == 200:  # held back until its first chunk
            self.head = headers
            return True
        return False

    def on_body(self, data: bytes) -> None:
        client, proxy = self.client, self.proxy
        if client is None or self.up is None:
            return
        if not self.started:
            self.started = True
            self.head.append((REPLICA_HEADER_B, self.up.url_b))
            client.stream_head(200, self.head)
        client.stream_body(data)
        self.due = proxy.now + proxy.config.stream_idle_timeout_s
        if client.writing_paused:
            self.pause_reading(True)

    def on_response(self, response: Response) -> None:
        status, headers, data = response
        if self.started:
            self._end(status)
            client, self.client = self.client, None
            if client is not None:
                client.stream_end()
            return self._release()
        up = self.up
        assert up is not None
        if status >= 500 and self.chains is not None:
            # The replica failed (vLLM answers 500 EngineDeadError while it shuts down): out of
            # rotation, and the request, which has no side effects, goes elsewhere.
            self._end(status, data[:200].decode(errors="replace"))
            return self.start()
        headers.append((REPLICA_HEADER_B, up.url_b))
        self._answer(response)  # the client first; the bookkeeping can wait
        self._end(status)
        self._release()

    def on_error(self, exc: OSError) -> None:
        self._fail(exc)

    def on_deadline(self) -> None:
        path = self.path.decode("latin-1")
        self._fail(TimeoutError(f"no answer within the deadline on {path}"))

    def expire(self) -> bool:
        """Its replica left rotation: end the try at the next tick (Upstream.expire_inflight)."""
        if self.due == 0.0 or self not in self.proxy.inflight:
            return False
        self.due = 0.0
        return True

"""What every request shares: settings, router, replicas, counters, deadlines; the error body."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.proxy.http.h1 import Response
from asyncgrpo.proxy.intake import Offload
from asyncgrpo.proxy.router import Router
from asyncgrpo.proxy.runs import Runs
from asyncgrpo.proxy.upstream import Inflight, UpstreamPool

__all__ = ["TICK_S", "Proxy", "ProxyStats", "error_answer", "json_answer"]

log = logging.getLogger(__name__)

#: How often deadlines are checked: one fires up to this late.
TICK_S = 0.1


class ProxyStats:
    """Counters the proxy keeps beyond the router's and the replicas' own."""

    def __init__(self) -> None:
        self.route_seconds = 0.0
        self.route_count = 0
        self.retries = 0
        self.rejected: Counter[int] = Counter()  # answered by the proxy itself, by status
        self.broadcasts: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome)
        self.lost_requests = 0  # tries that failed on a replica (each redone elsewhere or lost)
        self.lost_seconds = 0.0  # how long those tries had run: generation thrown away


class Proxy:
    """The state of one running proxy, looked up once per request. Deadlines are checked by
    :meth:`tick` every :data:`TICK_S` (a timer per request, armed and cancelled, cost uvloop a
    few microseconds each), which also keeps ``now``, the loop's time at its last pass: a
    deadline far off needs no clock read."""

    __slots__ = (
        "config",
        "inflight",
        "loop",
        "now",
        "offload",
        "pool",
        "router",
        "runs",
        "stats",
        "tasks",
    )

    def __init__(self, config: ProxyConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.loop = loop
        self.router = Router(
            imbalance=config.imbalance,
            imbalance_ratio=config.imbalance_ratio,
            max_blocks=config.max_tracked_blocks,
            policy=config.routing,
        )
        self.pool = UpstreamPool(config, self.router, self.spawn)
        self.runs = Runs(
            lease_s=config.run_lease_s,
            max_runs=config.max_runs,
            max_queued=config.max_queued_per_run,
            queue_timeout_s=config.queue_timeout_s,
        )
        self.runs.per_replica = config.max_inflight_per_replica or None
        self.stats = ProxyStats()
        self.offload = Offload()  # reads large generation bodies off the event loop
        self.inflight: set[Inflight] = set()  # relayed requests, each with its deadline
        self.now = loop.time()
        self.tasks: set[asyncio.Task[None]] = set()  # control calls and the health checker

    def spawn(self, coro: object, name: str) -> asyncio.Task[None]:
        """Run ``coro`` until it ends or the proxy stops (a client going away does not stop it:
        a broadcast half done would leave the replicas disagreeing)."""
        task = self.loop.create_task(coro, name=name)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def tick(self) -> float:
        """End the requests past their deadline; size the runs' shares to the replicas in
        rotation; returns the time now."""
        self.now = now = self.loop.time()
        for request in [r for r in self.inflight if r.due <= now]:
            try:
                request.on_deadline()
            except Exception:  # a bug in one request must not stop every later deadline
                log.exception("ending a request at its deadline failed; it is dropped")
                self.inflight.discard(request)
        if self.runs.per_replica:
            self.runs.resize(len(self.pool.targets()), now)
        if self.runs.waiting:
            self.runs.expire_waiting(now)
        return now


def json_answer(
    status: int, obj: object, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Response:
    return status, [(b"Content-Type", b"application/json"), *headers], json.dumps(obj).encode()


#: OpenAI's error types by status (others: BadRequestError), so SDK clients show the kind.
_KINDS = {404: "NotFoundError", 409: "ConflictError", 500: "InternalServerError",
          502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}  # fmt: skip


def error_answer(status: int, message: str) -> Response:
    """An OpenAI-style error, so SDK clients show the message."""
    kind = _KINDS.get(status, "BadRequestError")
    return json_answer(
        status, {"error": {"message": message, "type": kind, "param": None, "code": status}}
    )

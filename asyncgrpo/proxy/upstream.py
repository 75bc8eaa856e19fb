"""The replicas: membership, circuit breaker, health checks, the deadlines of requests in flight.

A replica is in rotation while its circuit is CLOSED (or HALF_OPEN for a single probe request).
A refused connection, a deadline or a 5xx opens it at once, and (but for a deadline) moves the
deadline of every request in flight on it to *now*: none hangs on a replica whose engine stopped
while its HTTP server lingers (vLLM draining after SIGTERM). After ``circuit_open_s`` (doubling
per consecutive failure) a successful ``GET /health`` replays the loaded adapters and makes it
HALF_OPEN; the success of its one request closes the circuit. Membership and the broadcast
targets change here only (:meth:`UpstreamPool.add`, ``remove``, ``targets``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import Counter
from typing import Any, Protocol

from asyncgrpo.proxy.config import ProxyConfig, token_allowed
from asyncgrpo.proxy.h1 import ConnectFailed, H1Pool
from asyncgrpo.proxy.router import Router
from asyncgrpo.vllm_client import SERVER_INFO_PATH, already_loaded, block_size_of

__all__ = ["Circuit", "Inflight", "Upstream", "UpstreamPool", "failure_kind"]

log = logging.getLogger(__name__)

_MAX_OPEN_S = 30.0


class Circuit(enum.Enum):
    JOINING = "joining"  # added at run time, adapters being replayed; not in rotation yet
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


def failure_kind(outcome: int | BaseException) -> tuple[str, bool] | None:
    """The one table from an exchange's outcome (a status, or what it raised) to how it counts
    against the replica: (failure kind, trips the circuit), or None for no failure. A dropped
    connection does not trip it: it is also what a keep-alive race looks like, and a crashed
    replica is caught by the next refused connect or health check."""
    if isinstance(outcome, int):
        return (f"http_{outcome}", True) if outcome >= 500 else None
    if isinstance(outcome, ConnectFailed):
        return "connect", True
    if isinstance(outcome, TimeoutError):
        return "deadline", True
    return "disconnect", False


class Inflight(Protocol):
    """A request in flight on a replica."""

    def expire(self) -> bool:
        """Reach the request's deadline now; False if it was not waiting on one."""
        ...


class Upstream:
    """One vLLM replica as the proxy sees it."""

    def __init__(self, url: str, pool: H1Pool, circuit: Circuit) -> None:
        self.url = url
        self.url_b = url.encode()
        self.h1 = pool
        self.circuit = circuit
        self.healthy: bool | None = None  # last health check; None before the first
        self.last_error = ""
        self.open_until = 0.0
        self.consecutive_failures = 0
        self.routed = 0
        self.failures: Counter[str] = Counter()
        self.inflight: set[Inflight] = set()
        self.probe_inflight = False
        self.slow_health = 0  # consecutive health checks that timed out

    def expire_inflight(self) -> int:
        """Make every in-flight request on this replica hit its deadline now."""
        return sum(request.expire() for request in list(self.inflight))

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "circuit": self.circuit.value,
            "healthy": self.healthy,
            "last_error": self.last_error,
            "routed": self.routed,
            "failures": dict(self.failures),
        }


class UpstreamPool:
    """The replicas, the router's view of them, and the background health checker."""

    def __init__(self, config: ProxyConfig, router: Router) -> None:
        self.config = config
        self.router = router
        self.upstreams: dict[str, Upstream] = {}
        self.block_size: int | None = config.block_size
        # Loaded through the proxy: name -> (load endpoint, request body), replayed to joiners.
        self.adapters: dict[str, tuple[str, bytes]] = {}
        self.paused_query: str | None = None  # query of the last /pause, until /resume
        for url in config.upstreams:
            self.add(url, circuit=Circuit.CLOSED, configured=True)

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str, *, circuit: Circuit, configured: bool = False) -> Upstream:
        """Add a replica; it gets ``upstream_api_key`` if it was configured at start or its URL
        is on the ``upstream_key_urls`` allow-list (a replica added at run time)."""
        cfg = self.config
        token = cfg.upstream_api_key if configured or token_allowed(url, cfg) else None
        pool = H1Pool(url, auth=token, connect_timeout_s=cfg.connect_timeout_s)
        up = self.upstreams[url] = Upstream(url, pool, circuit)
        self.router.add_replica(url, available=circuit is Circuit.CLOSED)
        return up

    def remove(self, url: str) -> Upstream | None:
        up = self.upstreams.pop(url, None)
        self.router.remove_replica(url)
        if up is not None:
            up.expire_inflight()
            up.h1.close()
        return up

    def in_rotation(self) -> list[Upstream]:
        """Every replica but those still joining (what ``/health`` answers for)."""
        return [u for u in self.upstreams.values() if u.circuit is not Circuit.JOINING]

    def targets(self) -> list[Upstream]:
        """The replicas a broadcast goes to: those taking requests now."""
        ok = (Circuit.CLOSED, Circuit.HALF_OPEN)
        return [u for u in self.upstreams.values() if u.circuit in ok]

    def set_closed(self, up: Upstream) -> None:
        up.circuit = Circuit.CLOSED
        up.consecutive_failures = 0
        up.probe_inflight = False
        self.router.set_available(up.url, True)

    def close(self) -> None:
        for up in self.upstreams.values():
            up.h1.close()

    # -- request outcomes -------------------------------------------------------------------

    def on_routed(self, up: Upstream) -> None:
        up.routed += 1
        if up.circuit is Circuit.HALF_OPEN:
            # Only one probe request at a time on a half-open replica.
            up.probe_inflight = True
            self.router.set_available(up.url, False)

    def on_outcome(self, up: Upstream, outcome: int | BaseException, detail: str = "") -> bool:
        """Count ``outcome`` against ``up`` (:func:`failure_kind`); True if it was a failure."""
        failure = failure_kind(outcome)
        if failure is None:
            if up.circuit is Circuit.HALF_OPEN:
                log.info("replica %s back in rotation", up.url)
                self.set_closed(up)
            elif up.circuit is Circuit.CLOSED:
                up.consecutive_failures = 0
            return False
        kind, trip = failure
        if not detail and isinstance(outcome, BaseException):
            detail = f"{type(outcome).__name__}: {outcome}"
        self.on_failure(up, kind, detail, trip=trip)
        return True

    def on_failure(self, up: Upstream, kind: str, detail: str = "", *, trip: bool = True) -> None:
        """Count a failure; unless ``trip`` is False, the replica leaves rotation at once."""
        up.failures[kind] += 1
        up.last_error = f"{kind}: {detail}"[:300]
        if not trip:
            if up.circuit is Circuit.HALF_OPEN:
                self._open(up)
        elif up.circuit in (Circuit.CLOSED, Circuit.HALF_OPEN):
            # One slow request says the replica is slow, not that its other requests are lost:
            # expiring them all would pile them onto the other replicas (a cascade). A dead
            # engine answers 5xx or refuses the health check, and that expires them.
            self._open(up, expire=kind != "deadline")

    def _open(self, up: Upstream, *, expire: bool = True) -> None:
        up.consecutive_failures += 1
        wait = min(self.config.circuit_open_s * 2 ** (up.consecutive_failures - 1), _MAX_OPEN_S)
        up.open_until = time.monotonic() + wait
        up.circuit = Circuit.OPEN
        up.probe_inflight = False
        self.router.set_available(up.url, False)
        up.h1.close()  # its idle connections may be dead; the next request opens fresh ones
        n = up.expire_inflight() if expire else 0
        log.warning(
            "replica %s out of rotation for %.1f s (%s); %d in-flight requests expired",
            up.url, wait, up.last_error, n,
        )  # fmt: skip

    # -- calls to one replica, health ----------------------------------------------------------

    async def call(self, up: Upstream, method: str, path_qs: str, body: bytes | None = None,
                   timeout_s: float = 0) -> tuple[int, bytes]:  # fmt: skip
        """One control call under ``timeout_s`` (default ``broadcast_timeout_s``); raises
        OSError (TimeoutError too)."""
        timeout_s = timeout_s or self.config.broadcast_timeout_s
        status, _, data = await up.h1.fetch(method, path_qs, body, timeout_s=timeout_s)
        return status, data

    async def probe(self, up: Upstream) -> bool | None:
        """GET /health once: True healthy, False refused or 5xx (dead), None timed out (slow)."""
        timeout = self.config.health_timeout_s
        ok: bool | None
        try:
            status, _, _ = await up.h1.fetch("GET", "/health", timeout_s=timeout)
            ok = status == 200
            if not ok:
                up.last_error = f"health: HTTP {status}"
        except TimeoutError:
            ok = None
            up.last_error = f"health: no answer within {timeout} s"
        except OSError as exc:
            ok = False
            up.last_error = f"health: {type(exc).__name__}: {exc}"[:300]
        up.healthy = bool(ok)
        up.slow_health = up.slow_health + 1 if ok is None else 0
        return ok

    async def check(self, up: Upstream) -> None:
        """One health-check round for one replica, driving its circuit."""
        if up.circuit is Circuit.JOINING:
            return
        if up.circuit is Circuit.OPEN and time.monotonic() < up.open_until:
            return
        if up.circuit is Circuit.HALF_OPEN and up.probe_inflight:
            return
        result = await self.probe(up)
        if self.upstreams.get(up.url) is not up:
            return
        # A busy replica may answer /health late; only several slow answers in a row count.
        ok = result or (result is None and up.slow_health < self.config.health_timeouts_to_open)
        if up.circuit is Circuit.OPEN and ok:
            error = await self.replay(up)
            if error:
                up.last_error = f"replay: {error}"[:300]
                self._open(up)
                return
            log.info("replica %s healthy again: half-open", up.url)
            up.circuit = Circuit.HALF_OPEN
            self.router.set_available(up.url, True)
        elif up.circuit is Circuit.HALF_OPEN and not ok:
            self._open(up)
        elif up.circuit is Circuit.CLOSED and not ok:
            up.failures["health"] += 1
            self._open(up)

    async def replay(self, up: Upstream) -> str | None:
        """Bring a (re)joining replica up to date (loaded adapters, pause state); an error
        message, or None when it may enter rotation."""
        try:
            # A replica that fetches adapters itself fetches them again here: nothing of this
            # host's disk is needed to bring it up to date.
            for name, (endpoint, body) in list(self.adapters.items()):
                status, data = await self.call(up, "POST", endpoint, body)
                if status != 200 and not already_loaded(status, data):
                    return f"load {name}: HTTP {status} {data[:200].decode(errors='replace')}"
            if self.paused_query is not None:
                status, _ = await self.call(up, "POST", "/pause" + self.paused_query)
                if status != 200:
                    return f"pause: HTTP {status}"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    async def discover_block_size(self) -> int | None:
        """Read ``cache_config.block_size`` from the first replica that answers."""
        for up in list(self.upstreams.values()):
            try:
                status, _, data = await up.h1.fetch(
                    "GET", SERVER_INFO_PATH, timeout_s=self.config.health_timeout_s
                )
                size = block_size_of(json.loads(data)) if status == 200 else None
            except (OSError, ValueError):
                continue
            if size:
                log.info("KV block size %d (from %s/server_info)", size, up.url)
                return size
        return None

    async def run_health_checks(self) -> None:
        """Forever: discover the block size until known, probe every replica each interval."""
        while True:
            if self.block_size is None:
                self.block_size = await self.discover_block_size()
            await asyncio.gather(*(self.check(u) for u in list(self.upstreams.values())))
            await asyncio.sleep(self.config.health_interval_s)

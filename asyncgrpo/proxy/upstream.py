"""Replica state: circuit breaker, health checks, and the deadlines of requests in flight.

A replica is in rotation while its circuit is CLOSED (or HALF_OPEN for a single probe request).
Any refused connection, deadline or 5xx opens the circuit at once; every request still in flight
on it has its deadline moved to *now*, so none hangs on a replica whose engine has stopped while
its HTTP server lingers (vLLM draining after SIGTERM). After ``circuit_open_s`` (doubling on each
consecutive failure) a successful ``GET /health`` moves it to HALF_OPEN: it gets one request, and
that request's success closes the circuit.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from typing import Any, Protocol

import aiohttp
from yarl import URL

from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.h1 import ConnectFailed, H1Pool
from asyncgrpo.proxy.router import Router
from asyncgrpo.vllm_client import SERVER_INFO_PATH, already_loaded, block_size_of

__all__ = ["Circuit", "Deadline", "Upstream", "UpstreamPool", "failure_kind"]

log = logging.getLogger(__name__)

_MAX_OPEN_S = 30.0


class Circuit(enum.Enum):
    JOINING = "joining"  # added at run time, adapters being replayed; not in rotation yet
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


def failure_kind(outcome: int | BaseException) -> tuple[str, bool] | None:
    """The one table from an exchange's outcome (a status, or what it raised) to how it counts
    against the replica: (failure kind, trips the circuit), or None for no failure.

    A 5xx, a refused connect and a deadline trip the circuit. A dropped connection does not by
    itself: it is also what a keep-alive race looks like, and a crashed replica is caught by
    the next refused connect or health check. Every failure is worth a retry elsewhere while
    the client has received nothing (a completion has no side effects).
    """
    if isinstance(outcome, int):
        return (f"http_{outcome}", True) if outcome >= 500 else None
    if isinstance(outcome, ConnectFailed | aiohttp.ClientConnectorError):
        return "connect", True
    if isinstance(outcome, TimeoutError):
        return "deadline", True
    return "disconnect", False


class Deadline(Protocol):
    """A request in flight on a replica, as :class:`asyncio.Timeout` exposes its deadline."""

    def expired(self) -> bool: ...

    def reschedule(self, when: float | None) -> None: ...


class Upstream:
    """One vLLM replica as the proxy sees it."""

    def __init__(
        self, url: str, *, circuit: Circuit = Circuit.CLOSED, connect_timeout_s: float = 5.0
    ) -> None:
        self.url = url
        self.url_b = url.encode()
        # Non-streaming generation requests; None: aiohttp only.
        self.h1 = _h1_pool(url, connect_timeout_s)
        self.circuit = circuit
        self.healthy: bool | None = None  # last health check; None before the first
        self.last_error = ""
        self.open_until = 0.0
        self.consecutive_failures = 0
        self.routed = 0
        self.failures: Counter[str] = Counter()
        self.deadlines: set[Deadline] = set()
        self.probe_inflight = False
        self.slow_health = 0  # consecutive health checks that timed out

    def close(self) -> None:
        """Close the idle connections of the generation pool."""
        if self.h1 is not None:
            self.h1.close()

    def expire_inflight(self) -> int:
        """Make every in-flight request on this replica hit its deadline now."""
        now = asyncio.get_running_loop().time()
        n = 0
        for t in list(self.deadlines):
            if t.expired():
                continue
            try:
                t.reschedule(now)
            except RuntimeError:  # its request already left the ``async with`` (failing now)
                continue
            n += 1
        return n

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

    def __init__(self, config: ProxyConfig, router: Router, session: aiohttp.ClientSession):
        self.config = config
        self.router = router
        self.session = session
        self.upstreams: dict[str, Upstream] = {}
        self.block_size: int | None = config.block_size
        # Loaded through the proxy: name -> (load endpoint, request body), replayed to joiners.
        self.adapters: dict[str, tuple[str, bytes]] = {}
        self.paused_query: str | None = None  # query of the last /pause, until /resume
        self.headers = (
            {"Authorization": f"Bearer {config.upstream_api_key}"}
            if config.upstream_api_key
            else {}
        )
        self.header_lines = b"".join(f"{k}: {v}\r\n".encode() for k, v in self.headers.items())
        for url in config.upstreams:
            self.add(url)

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str, *, circuit: Circuit = Circuit.CLOSED) -> Upstream:
        up = self.upstreams.get(url)
        if up is None:
            up = self.upstreams[url] = Upstream(
                url, circuit=circuit, connect_timeout_s=self.config.connect_timeout_s
            )
        else:
            up.circuit = circuit
        self.router.add_replica(url, available=circuit is Circuit.CLOSED)
        return up

    def remove(self, url: str) -> Upstream | None:
        up = self.upstreams.pop(url, None)
        self.router.remove_replica(url)
        if up is not None:
            up.expire_inflight()
            up.close()
        return up

    def in_rotation(self) -> list[Upstream]:
        return [u for u in self.upstreams.values() if u.circuit is not Circuit.JOINING]

    def set_closed(self, up: Upstream) -> None:
        up.circuit = Circuit.CLOSED
        up.consecutive_failures = 0
        up.probe_inflight = False
        self.router.set_available(up.url, True)

    # -- request outcomes -------------------------------------------------------------------

    def on_routed(self, up: Upstream) -> None:
        up.routed += 1
        if up.circuit is Circuit.HALF_OPEN:
            # Only one probe request at a time on a half-open replica.
            up.probe_inflight = True
            self.router.set_available(up.url, False)

    def on_success(self, up: Upstream) -> None:
        if up.circuit is Circuit.HALF_OPEN:
            log.info("replica %s back in rotation", up.url)
            self.set_closed(up)
        elif up.circuit is Circuit.CLOSED:
            up.consecutive_failures = 0

    def on_outcome(self, up: Upstream, outcome: int | BaseException, detail: str = "") -> bool:
        """Count ``outcome`` against ``up`` (:func:`failure_kind`); True if it was a failure."""
        failure = failure_kind(outcome)
        if failure is None:
            self.on_success(up)
            return False
        kind, trip = failure
        if not detail and isinstance(outcome, BaseException):
            detail = f"{type(outcome).__name__}: {outcome}"
        self.on_failure(up, kind, detail, trip=trip)
        return True

    def on_failure(self, up: Upstream, kind: str, detail: str = "", *, trip: bool = True) -> None:
        """A refused connection, deadline or 5xx: out of rotation at once.

        ``trip=False`` only counts it: a dropped keep-alive connection (the server closed it just
        as we reused it) says nothing about the replica; the request is retried and the next
        connect or health check decides.
        """
        up.failures[kind] += 1
        up.last_error = f"{kind}: {detail}"[:300]
        if not trip:
            if up.circuit is Circuit.HALF_OPEN:
                self._open(up)
            return
        if up.circuit in (Circuit.CLOSED, Circuit.HALF_OPEN):
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
        up.close()  # its idle connections may be dead; the next request opens fresh ones
        n = up.expire_inflight() if expire else 0
        log.warning(
            "replica %s out of rotation for %.1f s (%s); %d in-flight requests expired",
            up.url,
            wait,
            up.last_error,
            n,
        )

    # -- health ------------------------------------------------------------------------------

    async def probe(self, up: Upstream) -> bool | None:
        """GET /health once: True healthy, False refused or 5xx (dead), None timed out (slow).

        Updates ``up.healthy`` and ``up.last_error``.
        """
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        ok: bool | None
        try:
            async with self.session.get(
                up.url + "/health", headers=self.headers, timeout=timeout
            ) as r:
                await r.read()
                ok = r.status == 200
                if not ok:
                    up.last_error = f"health: HTTP {r.status}"
        except TimeoutError:
            ok = None
            up.last_error = f"health: no answer within {self.config.health_timeout_s} s"
        except (aiohttp.ClientError, OSError) as exc:
            ok = False
            up.last_error = f"health: {type(exc).__name__}: {exc}"[:300]
        up.healthy = bool(ok)
        if ok is None:
            up.slow_health += 1
        else:
            up.slow_health = 0
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
        if up.url not in self.upstreams:
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

    async def post(
        self, up: Upstream, path_qs: str, body: bytes | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """POST to one replica; raises aiohttp/OS errors and TimeoutError to the caller."""
        return await self.request("POST", up, path_qs, body, timeout_s)

    async def request(
        self, method: str, up: Upstream, path_qs: str, body: bytes | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """One control request to one replica; raises aiohttp/OS errors and TimeoutError."""
        headers = {"Content-Type": "application/json", **self.headers}
        async with self.session.request(
            method,
            up.url + path_qs,
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            return r.status, await r.read()

    async def replay(self, up: Upstream) -> str | None:
        """Bring a (re)joining replica up to date: loaded adapters, then pause state.

        Returns an error message, or None when the replica may enter rotation.
        """
        timeout = self.config.broadcast_timeout_s
        try:
            # A replica that fetches adapters itself fetches them again here: nothing of this
            # host's disk is needed to bring it up to date.
            for name, (endpoint, body) in list(self.adapters.items()):
                status, data = await self.post(up, endpoint, body, timeout)
                if status != 200 and not already_loaded(status, data):
                    return f"load {name}: HTTP {status} {data[:200].decode(errors='replace')}"
            if self.paused_query is not None:
                status, data = await self.post(up, "/pause" + self.paused_query, None, timeout)
                if status != 200:
                    return f"pause: HTTP {status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    async def discover_block_size(self) -> int | None:
        """Read ``cache_config.block_size`` from the first replica that answers."""
        for up in list(self.upstreams.values()):
            try:
                async with self.session.get(
                    up.url + SERVER_INFO_PATH,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s),
                ) as r:
                    if r.status != 200:
                        continue
                    info = await r.json(content_type=None)
                size = block_size_of(info)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
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


def _h1_pool(url: str, connect_timeout_s: float) -> H1Pool | None:
    """A raw keep-alive pool for plain ``http://host:port`` replicas (no path, no TLS)."""
    u = URL(url)
    if u.scheme != "http" or u.path not in ("", "/") or u.query_string or not u.raw_host:
        return None
    return H1Pool(u.raw_host, u.port or 80, connect_timeout_s=connect_timeout_s)

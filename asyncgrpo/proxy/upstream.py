"""The replicas: membership, circuit breaker, health checks, the deadlines of requests in flight.

The fleet is the replicas in rotation: circuit CLOSED (or HALF_OPEN for a single probe request).
A refused connection, a deadline or a 5xx opens the circuit at once: the replica leaves the fleet,
and (but for a deadline) the deadline of every request in flight on it moves to *now*: none hangs
on a replica whose engine stopped while its HTTP server lingers (vLLM draining after SIGTERM).
After ``circuit_open_s`` (doubling per consecutive failure) a successful ``GET /health`` starts
its catch-up (:meth:`UpstreamPool.catch_up`, also what a replica added at run time goes through):
the adapters loaded through the proxy are replayed to it, then, holding the fleet lock that every
broadcast holds, what changed meanwhile and the pause state; only then does it return, HALF_OPEN,
whose one request's success closes the circuit. So a replica never takes a request for a version
it lacks. Membership and the broadcast targets change here only (:meth:`UpstreamPool.add`,
``remove``, ``targets``, ``catch_up``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from asyncgrpo.config.proxy import ProxyConfig, token_allowed
from asyncgrpo.proxy.http.h1 import ConnectFailed, H1Pool
from asyncgrpo.proxy.router import Router
from asyncgrpo.retry import Backoff
from asyncgrpo.vllm import api

__all__ = ["Circuit", "Inflight", "Upstream", "UpstreamPool", "failure_kind"]

log = logging.getLogger(__name__)

_MAX_OPEN_S = 30.0
RETIRED_KEPT = 4096


class Circuit(enum.Enum):
    JOINING = "joining"  # added at run time, catching up; not in rotation yet
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
    """A request in flight on a replica: its deadline ``due`` (loop time), checked every tick."""

    due: float

    def on_deadline(self) -> None:
        """The deadline passed: end the request."""

    def expire(self) -> bool:
        """Reach the deadline at the next tick; False if it was not waiting on one."""
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
        #: adapters it holds as far as the proxy knows (loaded through it, not unloaded since):
        #: name -> the path it was loaded through
        self.adapters: dict[str, str] = {}
        self.paused: bool | None = False  # by the last pause/resume it got; None: unknown
        self.catching_up = False

    @property
    def serving(self) -> bool:
        """In the fleet: takes requests and broadcasts."""
        return self.circuit in (Circuit.CLOSED, Circuit.HALF_OPEN)

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
            "adapters": sorted(self.adapters),
        }


class UpstreamPool:
    """The replicas, the router's view of them, and the background health checker."""

    def __init__(
        self, config: ProxyConfig, router: Router, spawn: Callable[[Any, str], object]
    ) -> None:
        self.config = config
        self.router = router
        #: how long a replica stays out of rotation after its n-th failure in a row
        self.open_for = Backoff(config.circuit_open_s, max_s=_MAX_OPEN_S)
        self.upstreams: dict[str, Upstream] = {}
        self.block_size: int | None = config.block_size
        # Loaded through the proxy: name -> (load endpoint, request body), replayed to joiners.
        self.adapters: dict[str, tuple[str, bytes]] = {}
        self.paused_query: str | None = None  # query of the last /pause, until /resume
        #: held by every broadcast and by the last step of a catch-up: a replica enters the
        #: fleet between broadcasts, never during one
        self.fleet_lock = asyncio.Lock()
        self.fleet: Counter[str] = Counter()  # joins, rejoins, left, replays, replay_failures
        #: unloaded through the proxy: name -> load path, so a replica that was away while they
        #: were retired unloads them when it catches up (the newest RETIRED_KEPT)
        self.retired: dict[str, str] = {}
        self.spawn = spawn  # a task the proxy cancels and awaits when it stops
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
        """The fleet, which a broadcast goes to: the replicas taking requests now."""
        return [u for u in self.upstreams.values() if u.serving]

    def set_closed(self, up: Upstream) -> None:
        up.circuit = Circuit.CLOSED
        up.consecutive_failures = 0
        up.probe_inflight = False
        self.router.set_available(up.url, True)

    def retire(self, name: str, endpoint: str | None = None) -> None:
        """``name`` is being unloaded from the fleet: no longer replayed, unloaded from a
        replica that catches up holding it. ``endpoint``: the load endpoint of a name that never
        entered the fleet (a load taken back: a replica that missed the take-back may hold it)."""
        if (loaded := self.adapters.pop(name, None)) is not None:
            endpoint = loaded[0]
        if endpoint is not None:
            self.retired[name] = endpoint
            if len(self.retired) > RETIRED_KEPT:
                del self.retired[next(iter(self.retired))]

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
        if up.serving:
            self.fleet["left"] += 1
        up.adapters.clear()  # unknown now (it may have restarted): its catch-up asks it
        up.paused = None
        up.consecutive_failures += 1
        wait = self.open_for.delay(up.consecutive_failures)
        up.open_until = time.monotonic() + wait
        up.circuit = Circuit.OPEN
        up.probe_inflight = False
        self.router.set_available(up.url, False)
        up.h1.close()  # its idle connections may be dead; the next request opens fresh ones
        n = up.expire_inflight() if expire else 0
        log.warning(
            "replica %s out of rotation for %.1f s (%s); %d in-flight requests expired",
            up.url,
            wait,
            up.last_error,
            n,
        )

    # -- calls to one replica, health ----------------------------------------------------------

    async def call(
        self,
        up: Upstream,
        method: str,
        path_qs: str,
        body: bytes | None = None,
        timeout_s: float = 0,
    ) -> tuple[int, bytes]:
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
            status, _, _ = await up.h1.fetch("GET", api.HEALTH_PATH, timeout_s=timeout)
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
        if up.circuit is Circuit.JOINING or up.catching_up:
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
            # Its own task: the last step waits for the fleet lock, which a slow load holds,
            # and the health checks of the others must not wait with it.
            up.catching_up = True
            self.spawn(self._return(up), f"asyncgrpo-proxy-catch-up {up.url}")
        elif up.circuit is Circuit.HALF_OPEN and not ok:
            self._open(up)
        elif up.circuit is Circuit.CLOSED and not ok:
            up.failures["health"] += 1
            self._open(up)

    async def _return(self, up: Upstream) -> None:
        """A replica that left answers its health check again: back, HALF_OPEN, once caught
        up; else out again for longer."""
        try:
            error = await self.catch_up(up, Circuit.HALF_OPEN)
        finally:
            up.catching_up = False
        if self.upstreams.get(up.url) is not up:
            return
        if error:
            up.last_error = f"catch-up: {error}"[:300]
            self._open(up)
        else:
            self.fleet["rejoins"] += 1
            log.info("replica %s caught up and back: half-open", up.url)

    async def catch_up(self, up: Upstream, admit: Circuit) -> str | None:
        """Bring a joining or returning replica up to date, then put it in the fleet as
        ``admit``: the adapters loaded through the proxy are replayed (slow: each is fetched),
        then, holding the fleet lock, what changed meanwhile and the pause state, and it is
        admitted before the lock is released. An error message, or None once admitted."""
        error = await self._replay(up, ask=True)
        if error is None:
            async with self.fleet_lock:
                if self.upstreams.get(up.url) is not up:
                    return "removed while catching up"
                error = await self._replay(up)
                if error is None and admit is Circuit.CLOSED:
                    self.set_closed(up)
                elif error is None:
                    up.circuit = admit
                    self.router.set_available(up.url, True)
        self.fleet["replays" if error is None else "replay_failures"] += 1
        return error

    async def _replay(self, up: Upstream, *, ask: bool = False) -> str | None:
        """Load on ``up`` the adapters it lacks, unload those retired since, match the pause
        state; an error message, or None. ``ask``: first learn what it holds (``/v1/models``):
        a replica that restarted holds nothing, one that was only unreachable what it had."""
        try:
            if ask:
                if error := await self._settle(up):
                    return error
                status, data = await self.call(up, "GET", api.MODELS_PATH)
                if status != 200:
                    said = data[:200].decode(errors="replace")
                    return f"{api.MODELS_PATH}: HTTP {status} {said}"
                known = {**self.retired, **{n: path for n, (path, _) in self.adapters.items()}}
                served = api.model_ids(data)
                up.adapters = {name: known[name] for name in served if name in known}
            # A replica that fetches adapters itself fetches them again here: nothing of this
            # host's disk is needed to bring it up to date.
            for name, (endpoint, body) in list(self.adapters.items()):
                if name in up.adapters:
                    continue
                status, data = await self.call(up, "POST", endpoint, body)
                if status != 200 and not api.already_loaded(status, data):
                    return f"load {name}: HTTP {status} {data[:200].decode(errors='replace')}"
                up.adapters[name] = endpoint
            for name in up.adapters.keys() - self.adapters.keys():
                body = json.dumps(api.unload_body(name)).encode()
                status, data = await self.call(up, "POST", api.unload_path(up.adapters[name]), body)
                if status not in (200, 404):
                    return f"unload {name}: HTTP {status} {data[:200].decode(errors='replace')}"
                del up.adapters[name]
            if self.paused_query is not None and up.paused is not True:
                status, _ = await self.call(up, "POST", api.PAUSE_PATH + self.paused_query)
                if status != 200:
                    return f"pause: HTTP {status}"
                up.paused = True
            elif self.paused_query is None and up.paused is not False:
                status, _ = await self.call(up, "POST", api.RESUME_PATH)
                if status != 200:
                    return f"resume: HTTP {status}"
                up.paused = False
        except (OSError, ValueError, AttributeError) as exc:  # unreachable, or not vLLM's JSON
            return f"{type(exc).__name__}: {exc}"
        return None

    async def _settle(self, up: Upstream) -> str | None:
        """Wait (``broadcast_timeout_s`` at most) until ``up``'s plugin has no adapter load in
        progress; an error message, or None (also for a replica without the plugin).

        A load this proxy stopped waiting for (its deadline) goes on on the replica: read what
        it serves before that load lands, and a version retired meanwhile would land after the
        catch-up, unnoticed, and stay loaded (and cached) for good.
        """
        deadline = time.monotonic() + self.config.broadcast_timeout_s
        while True:
            status, data = await self.call(up, "GET", api.PLUGIN_INFO_PATH)
            if not (loading := api.loads_in_progress(up.url, status, data)):
                return None
            if time.monotonic() >= deadline:
                return f"adapter loads {loading} still in progress"
            await asyncio.sleep(0.2)

    async def settings(self) -> dict[str, int | None]:
        """What the proxy sizes itself by, from the fleet's ``/server_info``: ``block_size``,
        ``max_loras``, ``max_num_seqs``, each the smallest any replica says (None: none says)."""
        readers = {
            "block_size": api.block_size_of,
            "max_loras": api.lora_slots_of,
            "max_num_seqs": api.max_num_seqs_of,
        }

        async def one(up: Upstream) -> Any:
            timeout_s = self.config.health_timeout_s
            try:
                status, data = await self.call(up, "GET", api.SERVER_INFO_JSON, timeout_s=timeout_s)
                return json.loads(data) if status == 200 else None
            except (OSError, ValueError):
                return None

        infos = await asyncio.gather(*(one(u) for u in self.targets()))
        said = {k: [n for n in map(read, infos) if n is not None] for k, read in readers.items()}
        return {k: min(v, default=None) for k, v in said.items()}

    async def run_health_checks(self) -> None:
        """Forever: discover the block size until known, probe every replica each interval."""
        while True:
            if self.block_size is None and (size := (await self.settings())["block_size"]):
                log.info("KV block size %d (from the replicas' /server_info)", size)
                self.block_size = size
            await asyncio.gather(*(self.check(u) for u in list(self.upstreams.values())))
            await asyncio.sleep(self.config.health_interval_s)

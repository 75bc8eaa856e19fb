"""One routed generation request's attempts: route, count the outcome, retry elsewhere or give up.

Shared by the buffered path (:class:`~asyncgrpo.proxy.unary.UnaryRequest`, callbacks) and the
streaming one (:mod:`asyncgrpo.proxy.app`, a coroutine). Each attempt goes to a replica the router
picks among those not tried yet; a failed one (:func:`~asyncgrpo.proxy.upstream.failure_kind`)
withdraws its routing claims, counts against the replica, and the request goes elsewhere (a
completion has no side effects) up to ``max_attempts``; then the answer is a 503 naming the
last error.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy.h1 import Response
from asyncgrpo.proxy.router import Decision, request_hashes
from asyncgrpo.proxy.state import Core, error_body
from asyncgrpo.proxy.upstream import Upstream

__all__ = ["FALLBACK_BLOCK_SIZE", "Attempts", "request_chains"]

log = logging.getLogger(__name__)

#: Block size used for hashing until the replicas' /server_info has been read.
FALLBACK_BLOCK_SIZE = 16


def request_chains(core: Core, parsed: dict[str, Any]) -> list[tuple[int, ...]]:
    """The routing key of a parsed generation request (empty when routing ignores prefixes)."""
    if core.router.policy != "affinity":
        return []
    t0 = time.perf_counter()
    try:
        chains = request_hashes(parsed, core.pool.block_size or FALLBACK_BLOCK_SIZE)
    except Exception:  # a router bug must not cost the request: route it unmatched
        log.exception("no routing key for a generation request")
        chains = []
    core.stats.route_seconds += time.perf_counter() - t0
    return chains


class Attempts:
    """The attempts of one request: :meth:`next` routes one, :meth:`done` ends it."""

    __slots__ = ("chains", "core", "decision", "last_error", "path", "tried", "up")

    def __init__(self, core: Core, chains: list[tuple[int, ...]], path: str) -> None:
        self.core = core
        self.chains = chains
        self.path = path
        self.tried: list[str] = []
        self.last_error = ""
        self.up: Upstream | None = None  # of the attempt in progress
        self.decision: Decision | None = None

    def next(self) -> Upstream | None:
        """Route the next attempt; None when ``max_attempts`` are spent or none is in rotation."""
        core = self.core
        if len(self.tried) >= core.config.max_attempts:
            return None
        t0 = time.perf_counter()
        try:
            decision = core.router.route(self.chains, exclude=self.tried)
        except NoHealthyReplica:
            return None
        up = core.pool.upstreams[decision.replica]
        self.up, self.decision = up, decision
        self.tried.append(up.url)
        core.stats.route_seconds += time.perf_counter() - t0
        core.stats.route_count += 1
        core.pool.on_routed(up)
        return up

    def done(self, outcome: int | BaseException | None, detail: str = "") -> bool:
        """End the attempt in progress with ``outcome`` (a status, what it raised, or None: the
        client went away). True if it failed and the request should try :meth:`next`."""
        up, decision = self.up, self.decision
        if up is None or decision is None:
            return False
        self.up = self.decision = None
        core = self.core
        if outcome is None:
            core.router.finish(decision, ok=False)
            return False
        failed = core.pool.on_outcome(up, outcome, detail)
        core.router.finish(decision, ok=not failed and isinstance(outcome, int) and outcome < 300)
        if failed:
            reason = outcome if isinstance(outcome, int) else type(outcome).__name__
            self.last_error = f"{up.url}: {reason}" + (f" ({detail[:200]})" if detail else "")
            if len(self.tried) < core.config.max_attempts:
                core.stats.retries += 1
                log.info("retrying %s elsewhere after %s", self.path, self.last_error)
        return failed

    def exhausted(self) -> Response:
        """The 503 for a request no replica could serve."""
        self.core.stats.reject(503)
        message = (
            f"no replica could serve the request (tried {len(self.tried)}): "
            f"{self.last_error or 'none in rotation'}"
        )
        body = error_body(503, message, kind="ServiceUnavailableError")
        return 503, [(b"Content-Type", b"application/json")], body

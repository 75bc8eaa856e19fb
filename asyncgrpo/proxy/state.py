"""State shared by the proxy's handlers: typed app keys, counters, the error body."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from aiohttp import web

from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.deadlines import Deadlines
from asyncgrpo.proxy.router import Router
from asyncgrpo.proxy.upstream import UpstreamPool

__all__ = [
    "CONFIG",
    "CORE",
    "POOL",
    "ROUTER",
    "STATS",
    "Core",
    "ProxyStats",
    "error_body",
    "error_response",
]


class ProxyStats:
    """Counters the proxy keeps beyond the router's and the replicas' own."""

    def __init__(self) -> None:
        self.route_seconds = 0.0
        self.route_count = 0
        self.retries = 0
        self.rejected: dict[int, int] = {}
        self.broadcasts: dict[tuple[str, str], int] = {}
        self.started = time.time()

    def reject(self, status: int) -> None:
        self.rejected[status] = self.rejected.get(status, 0) + 1

    def broadcast(self, endpoint: str, outcome: str) -> None:
        key = (endpoint, outcome)
        self.broadcasts[key] = self.broadcasts.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class Core:
    """What every request needs, looked up once (not four app-dict lookups per request)."""

    config: ProxyConfig
    router: Router
    pool: UpstreamPool
    stats: ProxyStats
    deadlines: Deadlines  # of the buffered generation requests in flight


CONFIG = web.AppKey("config", ProxyConfig)
ROUTER = web.AppKey("router", Router)
POOL = web.AppKey("pool", UpstreamPool)
STATS = web.AppKey("stats", ProxyStats)
CORE = web.AppKey("core", Core)  # set when the upstream pool starts


def error_body(status: int, message: str, *, kind: str = "BadRequestError") -> bytes:
    """An OpenAI-style error body, so SDK clients show the message."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return json.dumps(body).encode()


def error_response(status: int, message: str, *, kind: str = "BadRequestError") -> web.Response:
    """:func:`error_body` as an aiohttp response."""
    return web.Response(
        body=error_body(status, message, kind=kind),
        status=status,
        content_type="application/json",
    )

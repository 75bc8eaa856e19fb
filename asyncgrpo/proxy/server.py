"""Start and stop the proxy: the open-file limit, the replicas' health checks, the listening socket.

One HTTP server (:mod:`asyncgrpo.proxy.front`) answers every route in this event loop; calls to
the replicas go through each one's pool (:mod:`asyncgrpo.proxy.http.h1`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy.front import Clients, Connection
from asyncgrpo.proxy.http.policy import connection_cap, raise_open_files
from asyncgrpo.proxy.state import TICK_S, Proxy

__all__ = ["raise_open_files", "serve_proxy"]

log = logging.getLogger(__name__)


async def _tick(proxy: Proxy, clients: Clients) -> None:
    """Every tick, the requests past their deadline; every few, the connections past theirs."""
    n = 0
    while True:
        await asyncio.sleep(TICK_S)
        n += 1
        try:
            now = proxy.tick()
            if n % clients.every == 0:
                clients.sweep(now)
        except Exception:  # this task must outlive a bug: every later deadline depends on it
            log.exception("the proxy's periodic deadline check failed; it goes on")


@asynccontextmanager
async def serve_proxy(config: ProxyConfig) -> AsyncIterator[str]:
    """Run the proxy in this event loop; yields its base URL (``port=0`` picks a free port)."""
    cap = connection_cap(config.max_connections)
    loop = asyncio.get_running_loop()
    proxy = Proxy(config, loop)
    clients: Clients | None = None
    server: asyncio.Server | None = None
    try:
        pool = proxy.pool
        if pool.block_size is None or config.max_inflight_per_replica is None:
            said = await pool.settings()
            pool.block_size = pool.block_size or said["block_size"]
            if config.max_inflight_per_replica is None:  # the replicas' own batch size
                proxy.runs.per_replica = said["max_num_seqs"]
        proxy.runs.resize(len(pool.targets()), loop.time())
        proxy.spawn(pool.run_health_checks(), "asyncgrpo-proxy-health")
        clients = Clients(proxy, cap)
        proxy.spawn(_tick(proxy, clients), "asyncgrpo-proxy-deadlines")
        try:
            server = await loop.create_server(
                lambda: Connection(clients), config.host, config.port, backlog=1024
            )
        except OSError as exc:  # a busy port or an address not on this host: the user's to fix
            raise ConfigError(
                f"cannot listen on {config.host}:{config.port} ({exc.strerror or exc}): "
                "choose another --port / proxy.port, or stop what holds it"
            ) from exc
        host, port = server.sockets[0].getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info(
            "proxy on %s over %d replicas (routing=%s, block_size=%s)",
            url,
            len(pool.upstreams),
            config.routing,
            pool.block_size,
        )
        yield url
    finally:
        if server is not None:
            server.close()
        if clients is not None:
            clients.close()
        tasks = list(proxy.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proxy.pool.close()
        await proxy.offload.aclose()
        if server is not None:
            await server.wait_closed()

"""The one URL a run sends completions and adapter broadcasts to, and what stands behind it.

A run (the trainer, or a rollout process) starts ``serve.replicas`` local vLLM replicas and/or
uses ``proxy.upstreams``. :func:`open_endpoint` decides what to put in front of them:

- ``serve.replicas: 0`` and ``proxy.upstreams`` one URL that is itself an asyncgrpo proxy (it
  answers ``GET /proxy/upstreams``): that proxy is the endpoint, used directly with
  ``proxy.upstream_api_key``. No proxy of the run's own sits in front of it, so a broadcast
  crosses one proxy on its way to the replicas.
- otherwise an in-process proxy (the ``proxy`` section) in front of the local replicas and the
  upstreams. It cannot be avoided there: local replicas listen on this host's loopback, which a
  standalone proxy elsewhere cannot reach, and a list of several URLs needs a proxy to route
  among them (a standalone proxy among them is then one more upstream, and is nested).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.config.training import run_transport_url
from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.proxy.admin_client import ProxyClient
from asyncgrpo.proxy.server import serve_proxy
from asyncgrpo.serve import ServeConfig, launch_replicas

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig

logger = logging.getLogger(__name__)


#: What a request to the fleet may take on a host that started its replicas at a normal pace.
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Endpoint:
    """Where the run's clients send requests, and the key they send."""

    url: str
    api_key: str | None
    #: a standalone asyncgrpo proxy given in ``proxy.upstreams``, not one of the run's own
    standalone: bool = False
    #: how long the run's first requests (``/server_info``, the first loads) may take
    request_timeout_s: float = REQUEST_TIMEOUT_S


def request_timeout(started_s: float | None, startup_timeout_s: float) -> float:
    """The first requests' time-out, scaled by what the host showed: replicas that took
    ``started_s`` seconds to start on a loaded host answer their first requests slowly too
    (vLLM gathers its environment report on the first ``/server_info``). Twice the start time,
    at least :data:`REQUEST_TIMEOUT_S`, at most ``serve.startup_timeout_s``, the setting a
    user raises."""
    if started_s is None:
        return min(REQUEST_TIMEOUT_S, startup_timeout_s)
    return max(REQUEST_TIMEOUT_S, min(2 * started_s, startup_timeout_s))


def replica_config(cfg: TrainingConfig, transport_url: str | None = None) -> ServeConfig:
    """The settings of the replicas a run starts itself: ``serve``, with the run's log and cache
    directories, allowed to fetch adapters from the run's transport."""
    return dataclasses.replace(
        cfg.serve,
        log_dir=cfg.serve.log_dir or str(cfg.run_dir / "replica-logs"),
        transports=(transport_url or run_transport_url(cfg),),
        adapter_cache_dir=cfg.serve.adapter_cache_dir or str(cfg.run_dir / "replica-adapters"),
    )


def upstream_key(cfg: TrainingConfig) -> str | None:
    """The key the run's own proxy sends upstream. It sends one key to every replica it starts
    with, so replicas the run starts with ``serve.api_key`` get that key (``proxy.upstream_api_key``
    unset); a different ``proxy.upstream_api_key`` could never reach both and is refused."""
    key, own = cfg.proxy.upstream_api_key, cfg.serve.api_key if cfg.serve.replicas else None
    if own is None or key in (None, own):
        return own or key
    raise ConfigError(
        "serve.api_key and proxy.upstream_api_key differ while the run starts replicas "
        "(serve.replicas >= 1): its proxy sends one key to every replica; give both the same "
        "value, or unset proxy.upstream_api_key"
    )


async def standalone_proxy(cfg: TrainingConfig) -> Endpoint | None:
    """The endpoint when ``proxy.upstreams`` names one standalone asyncgrpo proxy and the run
    starts no replica of its own; else None."""
    if cfg.serve.replicas or len(cfg.proxy.upstreams) != 1:
        return None
    url = cfg.proxy.upstreams[0].rstrip("/")
    key = cfg.proxy.upstream_api_key
    async with ProxyClient(url, api_key=key, timeout_s=30) as client:
        try:
            replicas = await client.proxy_upstreams()
        except ReplicaError as exc:
            raise ReplicaError(f"proxy.upstreams: {url} cannot be reached ({exc})") from exc
    if replicas is None:
        return None
    logger.info("%s is an asyncgrpo proxy (replicas %s): using it directly", url, replicas)
    return Endpoint(url=url, api_key=key, standalone=True)


@asynccontextmanager
async def open_endpoint(
    cfg: TrainingConfig,
    cache_dir: Path,
    transport_url: str,
    *,
    phase: Callable[[str], None] | None = None,
) -> AsyncIterator[Endpoint]:
    """The run's endpoint (see the module docstring); stops what it started on exit.

    Local replicas may fetch adapters from the run's transport themselves, like remote ones; an
    in-process proxy accepts load paths only under ``cache_dir``, where the trainer fetches
    versions for replicas that share its disk. ``phase`` hears what is starting (the replicas
    take a minute on a CPU): :meth:`asyncgrpo.run.progress.RunProgress.phase`.
    """
    say = phase or (lambda text: None)
    given = await standalone_proxy(cfg)
    if given is not None:
        say(f"using the asyncgrpo proxy at {given.url}")
        yield given
        return
    proxy = dataclasses.replace(
        cfg.proxy,
        upstream_api_key=upstream_key(cfg),
        lora_roots=(*cfg.proxy.lora_roots, str(cache_dir)),
    )
    serve = replica_config(cfg, transport_url) if cfg.serve.replicas else None
    if cfg.proxy.upstreams:
        say(f"{len(cfg.proxy.upstreams)} remote replica(s) behind the run's proxy")
    started = time.monotonic()
    async with open_fleet(serve, proxy, phase=say) as url:
        took = time.monotonic() - started if serve is not None else None
        yield Endpoint(
            url=url,
            api_key=cfg.proxy.api_key,
            request_timeout_s=request_timeout(took, cfg.serve.startup_timeout_s),
        )


@asynccontextmanager
async def open_fleet(
    serve: ServeConfig | None, proxy: ProxyConfig, *, phase: Callable[[str], None]
) -> AsyncIterator[str]:
    """``serve.replicas`` local vLLM replicas (none when ``serve`` is None) and an in-process
    proxy in front of them and ``proxy.upstreams``; yields the proxy's URL and stops both on
    exit. The one starter of a fleet: a run's endpoint and the Tinker service's ``--replicas``."""
    async with AsyncExitStack() as stack:
        urls = list(proxy.upstreams)
        if serve is not None and serve.replicas:
            n = serve.replicas
            phase(f"starting {n} vLLM replica{'s' if n != 1 else ''} (logs in {serve.log_dir})")
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_still_starting, serve, started, phase)
                replicas = await stack.enter_async_context(launch_replicas(serve))
                tg.cancel_scope.cancel()
            phase(
                f"{n} replica{'s' if n != 1 else ''} healthy after "
                f"{time.monotonic() - started:.0f} s"
            )
            urls = [r.url for r in replicas] + urls
        url = await stack.enter_async_context(
            serve_proxy(dataclasses.replace(proxy, upstreams=tuple(urls)))
        )
        yield url


#: Seconds between two lines saying the replicas are still starting.
STILL_STARTING_EVERY_S = 30.0


async def _still_starting(serve: ServeConfig, started: float, phase: Callable[[str], None]) -> None:
    """While the replicas start, a line every :data:`STILL_STARTING_EVERY_S`: how long so far,
    the bound (``serve.startup_timeout_s``, the setting to raise on a slow host) and the last
    line of replica 0's log, so a slow start on a loaded host reads as progress, not a hang."""
    from asyncgrpo.processes import log_tail

    while True:
        await anyio.sleep(STILL_STARTING_EVERY_S)
        last = ""
        if serve.log_dir:
            tail = await anyio.to_thread.run_sync(
                log_tail, Path(serve.log_dir) / "replica-0.log", 1
            )
            last = f"; replica 0's log: {tail.strip()[-120:]}" if tail.strip() else ""
        phase(
            f"replicas still starting after {time.monotonic() - started:.0f} s (at most "
            f"serve.startup_timeout_s={serve.startup_timeout_s:g}){last}"
        )

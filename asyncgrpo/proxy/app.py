"""The proxy's HTTP side: parse, ask the router, forward bytes, report the outcome back.

Generation requests (``/v1/completions``, ``/v1/chat/completions``) are routed by KV-prefix
affinity and forwarded untouched (the body is parsed only to read ``model``, ``prompt`` /
``messages`` and ``stream``); streamed answers are passed through chunk by chunk. Control calls
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/pause``, ``/resume``,
``/reset_prefix_cache``) go to every replica (see :mod:`asyncgrpo.proxy.broadcast`). Any other GET
and ``/tokenize``, ``/detokenize`` go to one healthy replica. Buffered generation requests are
forwarded by :mod:`asyncgrpo.proxy.unary` (which the fast front calls directly); streams here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from asyncgrpo.errors import NoHealthyReplica
from asyncgrpo.proxy import broadcast, metrics
from asyncgrpo.proxy.attempts import Attempts, request_chains
from asyncgrpo.proxy.auth import AUTH_MESSAGE, authorized, expected_header
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.deadlines import Deadlines
from asyncgrpo.proxy.headers import DROP_REQUEST, DROP_RESPONSE, DROP_RESPONSE_B, REPLICA_HEADER
from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.router import Router
from asyncgrpo.proxy.state import (
    CONFIG,
    CORE,
    POOL,
    ROUTER,
    STATS,
    Core,
    ProxyStats,
    error_response,
)
from asyncgrpo.proxy.unary import forward_unary
from asyncgrpo.proxy.upstream import Circuit, Upstream, UpstreamPool
from asyncgrpo.vllm_client import PLUGIN_INFO_PATH, PLUGIN_LOAD_PATH, PLUGIN_UNLOAD_PATH

__all__ = ["REPLICA_HEADER", "create_app"]

log = logging.getLogger(__name__)


def _forward_headers(request: web.Request, pool: UpstreamPool) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROP_REQUEST}
    headers.update(pool.headers)
    return headers


def _response_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in DROP_RESPONSE}


def _gen_headers(upstream: aiohttp.ClientResponse, replica: str) -> dict[str, str]:
    headers = _response_headers(upstream)
    headers[REPLICA_HEADER] = replica
    return headers


# -- middlewares ------------------------------------------------------------------------------


def _auth_middleware(api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = expected_header(api_key)

    @web.middleware
    async def auth(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not authorized(expected, got):
            request.app[STATS].reject(401)
            return error_response(401, AUTH_MESSAGE, kind="AuthenticationError")
        return await handler(request)

    return auth


@web.middleware
async def _errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        request.app[STATS].reject(413)
        return error_response(413, f"request body too large: {exc.text}")
    except NoHealthyReplica as exc:
        request.app[STATS].reject(503)
        return error_response(503, f"no healthy replica: {exc}", kind="ServiceUnavailableError")


# -- generation -------------------------------------------------------------------------------


async def _parse_json(request: web.Request) -> tuple[bytes, dict[str, Any]]:
    body = await request.read()
    return body, decode_object(body, request.app[CONFIG].max_body_bytes)


class _Retry(Exception):
    """This attempt failed before anything reached the client: try another replica."""


async def handle_generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    try:
        body, parsed = await _parse_json(request)
    except BodyError as exc:
        app[STATS].reject(exc.status)
        return error_response(exc.status, str(exc))
    core = app[CORE]
    headers = _forward_headers(request, core.pool)
    if parsed.get("stream") is not True:
        status, raw, data = await forward_unary(core, request.path_qs, parsed, body, headers)
        out = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in raw
            if k.lower() not in DROP_RESPONSE_B
        ]
        return web.Response(body=data, status=status, headers=out)
    attempts = Attempts(core, request_chains(core, parsed), request.path)
    while (up := attempts.next()) is not None:
        try:
            return await _forward_stream(request, core.config, attempts, up, body, headers)
        except _Retry:
            continue
    status, _, data = attempts.exhausted()
    return web.Response(body=data, status=status, content_type="application/json")


async def _forward_stream(
    request: web.Request,
    config: ProxyConfig,
    attempts: Attempts,
    up: Upstream,
    body: bytes,
    headers: dict[str, str],
) -> web.StreamResponse:
    """One streaming attempt. Retryable (:class:`_Retry`) until the first chunk is sent on."""
    pool = attempts.core.pool
    loop = asyncio.get_running_loop()
    deadline = asyncio.timeout_at(loop.time() + config.request_timeout_s)
    up.deadlines.add(deadline)
    out: web.StreamResponse | None = None
    try:
        async with deadline:
            async with pool.session.post(up.url + request.path_qs, data=body, headers=headers) as r:
                status = r.status
                if status != 200:
                    data = await r.read()
                    if attempts.done(status, data[:200].decode(errors="replace")):
                        raise _Retry
                    return web.Response(body=data, status=status, headers=_gen_headers(r, up.url))
                # Wait for the first chunk under the request deadline (still retryable), then
                # pass chunks through as they arrive under the idle deadline.
                first = await r.content.readany()
                out = web.StreamResponse(status=status, headers=_gen_headers(r, up.url))
                await out.prepare(request)
                idle = config.stream_idle_timeout_s
                chunk = first
                while chunk:
                    await out.write(chunk)
                    deadline.reschedule(loop.time() + idle)
                    chunk = await r.content.readany()
                await out.write_eof()
                attempts.done(status)
                return out
    except _Retry:
        raise
    except (aiohttp.ClientError, OSError) as exc:  # TimeoutError included
        if out is not None and request.transport is None:
            attempts.done(None)
            raise  # the client went away mid-stream; not the replica's fault
        attempts.done(exc)
        if out is None:
            raise _Retry from None
        raise  # mid-stream: the client already has part of the answer; drop the connection
    except BaseException:
        attempts.done(None)  # cancelled: the client went away
        raise
    finally:
        up.deadlines.discard(deadline)


# -- read-only pass-through -------------------------------------------------------------------


async def handle_passthrough(request: web.Request) -> web.StreamResponse:
    app = request.app
    config, pool = app[CONFIG], app[POOL]
    body = await request.read() if request.can_read_body else None
    headers = _forward_headers(request, pool)
    tried: list[str] = []
    timeout = aiohttp.ClientTimeout(total=config.broadcast_timeout_s)
    for _ in range(config.max_attempts):
        up = pool.upstreams[pool.router.pick(exclude=tried)]
        tried.append(up.url)
        try:
            async with pool.session.request(
                request.method,
                up.url + request.path_qs,
                data=body,
                headers=headers,
                timeout=timeout,
            ) as r:
                data = await r.read()
                return web.Response(body=data, status=r.status, headers=_response_headers(r))
        except (aiohttp.ClientError, OSError) as exc:  # TimeoutError included
            pool.on_outcome(up, exc, f"{request.path}: {type(exc).__name__}: {exc}")
    return error_response(
        503, f"no replica answered (tried {tried})", kind="ServiceUnavailableError"
    )


async def handle_not_allowed(request: web.Request) -> web.Response:
    return error_response(
        404,
        f"{request.method} {request.path} is not proxied: only GET, generation, tokenize and the "
        "broadcast control calls are",
        kind="NotFoundError",
    )


# -- proxy's own endpoints --------------------------------------------------------------------


async def handle_health(request: web.Request) -> web.Response:
    """200 only when every registered replica answers /health; otherwise 503 naming the others."""
    pool = request.app[POOL]
    ups = pool.in_rotation()
    results = await asyncio.gather(*(pool.probe(u) for u in ups))
    bad = [
        {"url": u.url, "circuit": u.circuit.value, "error": u.last_error}
        for u, ok in zip(ups, results, strict=True)
        if ok is not True or u.circuit is Circuit.OPEN
    ]
    if not ups or bad:
        return web.json_response(
            {"status": "unhealthy", "replicas": len(ups), "unhealthy": bad}, status=503
        )
    return web.json_response({"status": "ok", "replicas": len(ups)})


async def handle_stats(request: web.Request) -> web.Response:
    app = request.app
    return web.json_response(metrics.stats_json(app[ROUTER], app[POOL], app[STATS]))


async def handle_metrics(request: web.Request) -> web.Response:
    app = request.app
    text = metrics.render(app[ROUTER], app[POOL], app[STATS])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def handle_upstreams(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    if request.method == "GET":
        return web.json_response({"upstreams": [u.as_dict() for u in pool.upstreams.values()]})
    try:
        _, parsed = await _parse_json(request)
    except BodyError as exc:
        return error_response(exc.status, str(exc))
    url = str(parsed.get("url") or "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        return error_response(400, 'body must be {"url": "http://HOST:PORT"}')
    if request.method == "DELETE":
        if pool.remove(url) is None:
            return error_response(404, f"{url} is not an upstream", kind="NotFoundError")
        log.info("replica %s removed", url)
        return web.json_response({"removed": url})
    if url in pool.upstreams:
        return error_response(400, f"{url} is already an upstream")
    up = pool.add(url, circuit=Circuit.JOINING)
    error = await pool.replay(up)
    if error:
        pool.remove(url)
        return error_response(502, f"{url} could not join: {error}", kind="BadGatewayError")
    pool.set_closed(up)
    log.info("replica %s joined rotation", url)
    return web.json_response({"added": url, "adapters": sorted(pool.adapters)})


# -- application ------------------------------------------------------------------------------


def create_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application; the upstream session and health checker live in
    ``cleanup_ctx``, so they start with the server and stop with it."""
    middlewares = [_errors_middleware]
    if config.api_key:
        middlewares.insert(0, _auth_middleware(config.api_key))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = config
    app[ROUTER] = Router(
        imbalance=config.imbalance,
        imbalance_ratio=config.imbalance_ratio,
        max_blocks=config.max_tracked_blocks,
        policy=config.routing,
    )
    app[STATS] = ProxyStats()
    app.cleanup_ctx.append(_upstream_ctx)
    r = app.router
    r.add_post("/v1/completions", handle_generate)
    r.add_post("/v1/chat/completions", handle_generate)
    r.add_post("/v1/load_lora_adapter", broadcast.handle_load)
    r.add_post("/v1/unload_lora_adapter", broadcast.handle_unload)
    r.add_post(PLUGIN_LOAD_PATH, broadcast.handle_load)
    r.add_post(PLUGIN_UNLOAD_PATH, broadcast.handle_unload)
    r.add_get(PLUGIN_INFO_PATH, broadcast.handle_fetch_info)
    for path in ("/pause", "/resume", "/reset_prefix_cache"):
        r.add_post(path, broadcast.handle_broadcast)
    r.add_get("/health", handle_health)
    r.add_get("/metrics", handle_metrics)
    r.add_get("/proxy/stats", handle_stats)
    r.add_route("GET", "/proxy/upstreams", handle_upstreams)
    r.add_route("POST", "/proxy/upstreams", handle_upstreams)
    r.add_route("DELETE", "/proxy/upstreams", handle_upstreams)
    r.add_post("/tokenize", handle_passthrough)
    r.add_post("/detokenize", handle_passthrough)
    r.add_route("GET", "/{tail:.*}", handle_passthrough)
    r.add_route("*", "/{tail:.*}", handle_not_allowed)
    return app


async def _upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # keepalive_timeout below uvicorn's 5 s, so we rarely reuse a connection vLLM is closing.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4.0)
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # bodies pass through untouched, Content-Encoding included
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies (and skips their cost)
    )
    pool = app[POOL] = UpstreamPool(config, app[ROUTER], session)
    deadlines = Deadlines(asyncio.get_running_loop())
    app[CORE] = Core(config, app[ROUTER], pool, app[STATS], deadlines)
    if pool.block_size is None:
        pool.block_size = await pool.discover_block_size()
    checker = asyncio.create_task(pool.run_health_checks(), name="asyncgrpo-proxy-health")
    log.info(
        "proxy over %d replicas (routing=%s, block_size=%s)",
        len(pool.upstreams),
        config.routing,
        pool.block_size,
    )
    try:
        yield
    finally:
        checker.cancel()
        deadlines.close()
        try:
            await checker
        except asyncio.CancelledError:
            pass
        for up in pool.upstreams.values():
            up.close()
        await session.close()

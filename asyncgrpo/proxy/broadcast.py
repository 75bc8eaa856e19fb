"""Control calls that must reach every replica: adapter load (all-or-nothing), unload, pause...

Two load endpoints go through the same broadcast: vLLM's ``/v1/load_lora_adapter`` (a local
``lora_path``, which must be under ``lora_roots``) and the asyncgrpo replica plugin's
``/v1/asyncgrpo/load`` (a transport ``lora_uri`` the replica fetches itself; each replica checks it
against the transport roots it was started with, so the proxy does not second-guess it).
A load is retried on one replica only while it answers that the adapter is not there yet (vLLM's
``No adapter found``, the plugin's ``AdapterNotPublished``), up to ``load_deadline_s``; on
deadline the proxy answers 504,
never 404 (TRL reads 404 as "runtime LoRA updating is disabled"). Any other rejection unloads the
adapter from the replicas that accepted it, and the rejection is returned. "Already loaded" counts
as a rejection: adapter names are never reused, so it means another adapter holds the name there.
A replica that cannot be reached leaves rotation instead of failing the load; it gets every loaded
adapter replayed before it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from asyncgrpo.proxy.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.state import CONFIG, POOL, STATS, error_response
from asyncgrpo.proxy.upstream import Circuit, Upstream, UpstreamPool
from asyncgrpo.vllm_client import PLUGIN_INFO_PATH, PLUGIN_LOAD_PATH, adapter_not_there_yet

__all__ = [
    "check_lora_path",
    "handle_broadcast",
    "handle_fetch_info",
    "handle_load",
    "handle_unload",
]

log = logging.getLogger(__name__)


def check_lora_path(path: object, roots: tuple[str, ...]) -> str | None:
    """Why ``path`` may not be loaded, or None. Absolute, no ``..``, under a root if any."""
    if not isinstance(path, str) or not path:
        return "lora_path must be a non-empty string"
    if not posixpath.isabs(path):
        return f"lora_path {path!r} must be absolute"
    if ".." in path.split("/"):
        return f"lora_path {path!r} must not contain '..'"
    if not roots:
        return None
    norm = posixpath.normpath(path)

    def under(p: str, root: str) -> bool:
        root = root.rstrip("/") or "/"
        return p == root or p.startswith(root if root == "/" else root + "/")

    if not any(under(norm, r) for r in roots):
        return f"lora_path {path!r} is outside the allowed roots {list(roots)}"
    if os.path.lexists(norm):  # a symlink inside a root must not lead outside it
        real = os.path.realpath(norm)
        if not any(under(real, os.path.realpath(r)) for r in roots):
            return f"lora_path {path!r} resolves outside the allowed roots"
    return None


def _targets(pool: UpstreamPool) -> list[Upstream]:
    return [u for u in pool.upstreams.values() if u.circuit in (Circuit.CLOSED, Circuit.HALF_OPEN)]


def _error(status: int, message: str, kind: str) -> web.Response:
    return error_response(status, message, kind=kind)


async def _read_json(request: web.Request) -> tuple[bytes, dict | None]:
    body = await request.read()
    try:
        return body, decode_object(body, request.app[CONFIG].max_body_bytes)
    except BodyError:
        return body, None


@dataclass
class _Result:
    up: Upstream
    kind: str  # ok | lagging | rejected | unreachable
    status: int = 0
    body: bytes = b""


async def _load_one(
    pool: UpstreamPool, up: Upstream, endpoint: str, body: bytes, deadline: float
) -> _Result:
    config = pool.config
    loop = asyncio.get_running_loop()
    while True:
        remaining = deadline - loop.time()
        try:
            status, data = await pool.post(
                up, endpoint, body, min(config.broadcast_timeout_s, max(remaining, 1))
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            pool.on_failure(up, "broadcast", f"{type(exc).__name__}: {exc}")
            return _Result(up, "unreachable")
        if status == 200:
            return _Result(up, "ok", status, data)
        if adapter_not_there_yet(status, data):
            if loop.time() + config.load_retry_interval_s >= deadline:
                return _Result(up, "lagging", status, data)
            await asyncio.sleep(config.load_retry_interval_s)
            continue
        return _Result(up, "rejected", status, data)


async def handle_load(request: web.Request) -> web.Response:
    config, pool, stats = request.app[CONFIG], request.app[POOL], request.app[STATS]
    body, parsed = await _read_json(request)
    if parsed is None:
        return _error(400, "request body must be a JSON object", "BadRequestError")
    name = parsed.get("lora_name")
    if not isinstance(name, str) or not name:
        return _error(400, "lora_name must be a non-empty string", "BadRequestError")
    endpoint = request.path
    if endpoint == PLUGIN_LOAD_PATH:
        uri = parsed.get("lora_uri")
        why = None if isinstance(uri, str) and uri else "lora_uri must be a non-empty string"
    else:
        why = check_lora_path(parsed.get("lora_path"), config.lora_roots)
    if why:
        stats.broadcast("load", "forbidden")
        return _error(400, why, "BadRequestError")
    targets = _targets(pool)
    if not targets:
        return _error(503, "no replica in rotation", "ServiceUnavailableError")
    deadline = asyncio.get_running_loop().time() + config.load_deadline_s
    results = await asyncio.gather(*(_load_one(pool, u, endpoint, body, deadline) for u in targets))
    ok = [r for r in results if r.kind == "ok"]
    rejected = [r for r in results if r.kind == "rejected"]
    lagging = [r for r in results if r.kind == "lagging"]
    if not rejected and not lagging and ok:
        pool.adapters[name] = (endpoint, body)
        stats.broadcast("load", "ok")
        log.info("adapter %s loaded on %d replicas", name, len(ok))
        return web.Response(body=ok[0].body, status=200, content_type="text/plain")
    # All or nothing: take it back from those that accepted.
    if ok:
        unload = json.dumps({"lora_name": name}).encode()
        await asyncio.gather(
            *(_quiet_post(pool, r.up, "/v1/unload_lora_adapter", unload) for r in ok)
        )
    if rejected:
        first = rejected[0]
        stats.broadcast("load", "rejected")
        log.warning(
            "adapter %s rejected by %s (HTTP %d); rolled back on %d replicas",
            name,
            first.up.url,
            first.status,
            len(ok),
        )
        return web.Response(
            body=first.body,
            status=first.status,
            content_type="application/json",
            headers={"X-Asyncgrpo-Replica": first.up.url},
        )
    if lagging:
        stats.broadcast("load", "deadline")
        return _error(
            504,
            f"adapter {name} not found on {[r.up.url for r in lagging]} within "
            f"load_deadline_s={config.load_deadline_s}: storage has not caught up; rolled back",
            "GatewayTimeoutError",
        )
    stats.broadcast("load", "unreachable")
    return _error(503, "no replica could be reached", "ServiceUnavailableError")


async def _quiet_post(pool: UpstreamPool, up: Upstream, path: str, body: bytes | None) -> None:
    try:
        status, data = await pool.post(up, path, body, pool.config.broadcast_timeout_s)
        if status != 200:
            log.warning("%s %s during rollback: HTTP %d %r", up.url, path, status, data[:200])
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.warning("%s %s during rollback: %s", up.url, path, exc)


async def _post_all(
    pool: UpstreamPool, path_qs: str, body: bytes | None
) -> list[tuple[Upstream, int, bytes]]:
    async def one(up: Upstream) -> tuple[Upstream, int, bytes]:
        try:
            status, data = await pool.post(up, path_qs, body, pool.config.broadcast_timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            pool.on_failure(up, "broadcast", f"{type(exc).__name__}: {exc}")
            return up, 0, str(exc).encode()
        return up, status, data

    return list(await asyncio.gather(*(one(u) for u in _targets(pool))))


async def handle_unload(request: web.Request) -> web.Response:
    pool, stats = request.app[POOL], request.app[STATS]
    body, parsed = await _read_json(request)
    if parsed is None or not isinstance(parsed.get("lora_name"), str):
        return _error(400, 'body must be {"lora_name": NAME}', "BadRequestError")
    pool.adapters.pop(parsed["lora_name"], None)
    results = await _post_all(pool, request.path, body)
    if not results:
        return _error(503, "no replica in rotation", "ServiceUnavailableError")
    ok = [r for r in results if r[1] == 200]
    missing = [r for r in results if r[1] == 404]
    failed = [r for r in results if r[1] not in (200, 404) and r[1] != 0]
    if failed:
        stats.broadcast("unload", "failed")
        up, status, data = failed[0]
        return web.Response(body=data, status=status, headers={"X-Asyncgrpo-Replica": up.url})
    if ok:
        stats.broadcast("unload", "ok")
        return web.Response(body=ok[0][2], status=200, content_type="text/plain")
    if missing:
        stats.broadcast("unload", "not_found")
        return web.Response(body=missing[0][2], status=404, content_type="application/json")
    return _error(503, "no replica could be reached", "ServiceUnavailableError")


async def handle_broadcast(request: web.Request) -> web.Response:
    """/pause, /resume, /reset_prefix_cache: every replica in rotation, 200 only if all agree."""
    pool, stats = request.app[POOL], request.app[STATS]
    body = await request.read() if request.can_read_body else None
    results = await _post_all(pool, request.path_qs, body)
    endpoint = request.path.strip("/")
    failed = [
        {"url": up.url, "status": status, "body": data[:300].decode(errors="replace")}
        for up, status, data in results
        if status != 200
    ]
    if not results:
        return _error(503, "no replica in rotation", "ServiceUnavailableError")
    if failed:
        stats.broadcast(endpoint, "failed")
        return web.json_response(
            {"error": {"message": "not every replica agreed", "failed": failed, "code": 502}},
            status=502,
        )
    if request.path == "/pause":
        pool.paused_query = "?" + request.query_string if request.query_string else ""
    elif request.path == "/resume":
        pool.paused_query = None
    stats.broadcast(endpoint, "ok")
    return web.Response(body=results[0][2], status=200, content_type="application/json")


async def handle_fetch_info(request: web.Request) -> web.Response:
    """Every replica's adapter-plugin answer, so a trainer can check them all before a sync."""
    pool = request.app[POOL]

    async def one(up: Upstream) -> list[dict]:
        try:
            status, data = await pool.request(
                "GET", up, PLUGIN_INFO_PATH, None, pool.config.broadcast_timeout_s
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return [{"url": up.url, "status": 0, "body": f"{type(exc).__name__}: {exc}"}]
        try:
            info = json.loads(data) if status == 200 else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            return [{"url": up.url, "status": status, "body": data[:300].decode(errors="replace")}]
        if isinstance(info.get("replicas"), list):  # another proxy: report its replicas
            return info["replicas"]
        return [{"url": up.url, "status": status, "info": info}]

    targets = _targets(pool)
    if not targets:
        return _error(503, "no replica in rotation", "ServiceUnavailableError")
    answers = await asyncio.gather(*(one(u) for u in targets))
    return web.json_response({"replicas": [entry for answer in answers for entry in answer]})

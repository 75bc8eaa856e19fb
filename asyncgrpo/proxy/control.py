"""The proxy's control routes, each a plain coroutine: broadcasts, health, stats, metrics, admin.

A broadcast goes to the fleet, the replicas in rotation (:meth:`UpstreamPool.targets`), holding
the fleet lock so that no replica enters the fleet halfway through it. A replica that cannot be
reached, or answers 5xx (but 501, a refusal) and then fails its health check, leaves the fleet
instead of failing the broadcast (it catches up before it returns); a broadcast fails only when
no replica is left or a live one refuses. A load is all or nothing over the fleet: retried on one
replica only while it answers that the adapter is not there yet, up to ``load_deadline_s`` (then
504, never 404: TRL reads 404 as "runtime LoRA updating is disabled"); any other refusal
(a path load's "already loaded" included: the name may hold another adapter there) is rolled
back on the replicas that accepted it; a plugin load's "already loaded" is a success, its name
being the version its URI names. Rules and reasons: ``docs/proxy.md``, "Failures" and "Adapter broadcast".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import posixpath
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from asyncgrpo.config.proxy import split_url
from asyncgrpo.proxy.http.h1 import Response
from asyncgrpo.proxy.http.headers import REPLICA_HEADER_B
from asyncgrpo.proxy.http.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.metrics import CONTENT_TYPE_LATEST, render, runs_stats, stats_json
from asyncgrpo.proxy.paths import RUNS_PATH, STATS_PATH, UPSTREAMS_PATH
from asyncgrpo.proxy.runs import MAX_NAME, MAX_WEIGHT, MIN_WEIGHT, NAME, TOKEN, booking_refusal
from asyncgrpo.proxy.state import Proxy, error_answer, json_answer
from asyncgrpo.proxy.upstream import Circuit, Upstream
from asyncgrpo.retry import poll_until
from asyncgrpo.vllm import api

__all__ = ["ROUTES", "check_lora_path"]

log = logging.getLogger(__name__)

Handler = Callable[[Proxy, str, str, bytes], Awaitable[Response]]
#: Largest body of a control call (a load, a registration...): they are a few hundred bytes,
#: and are decoded on the event loop.
CONTROL_MAX_BODY = 64 * 1024
#: Longest replica URL accepted at run time (it becomes a label on ``/metrics``).
MAX_URL = 1024
#: How a plugin load's URI ends: ``/v<N>``, N with at most 18 digits (an int64).
_VERSION = re.compile(r"/v[0-9]{1,18}\Z")
_NONE = "no replica in rotation"


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


def _load_refusal(path: str, parsed: dict[str, Any], roots: tuple[str, ...]) -> str | None:
    """Why a load request may not go out, or None: vLLM's load rules (the plugin's too), then
    the proxy's on paths."""
    name = parsed.get("lora_name")
    if isinstance(name, str) and len(name) > MAX_NAME:
        return f"lora_name must be at most {MAX_NAME} characters"
    if why := api.load_refusal(parsed):
        return why
    if path != api.PLUGIN_LOAD_PATH:
        return check_lora_path(parsed.get("lora_path"), roots)
    return api.uri_refusal(parsed["lora_name"], parsed.get("lora_uri"))


async def _call(
    proxy: Proxy, up: Upstream, path_qs: str, body: bytes | None, timeout_s: float = 0
) -> tuple[int, bytes]:
    """POST to one replica of the fleet. One that cannot be reached, or answers 5xx (but 501, a
    refusal) and then fails its health check, leaves the fleet: status 0. vLLM answers 500 both
    from a dead engine and to an adapter it cannot apply (a LoRA on ``lm_head``): a replica
    that still answers ``/health`` refused, and stays."""
    try:
        status, data = await proxy.pool.call(up, "POST", path_qs, body, timeout_s)
    except OSError as exc:  # TimeoutError included
        proxy.pool.on_failure(up, "broadcast", f"{type(exc).__name__}: {exc}")
        return 0, str(exc).encode()
    if status >= 500 and status != 501 and not await proxy.pool.probe(up):
        proxy.pool.on_failure(up, f"http_{status}", f"{path_qs}: {data[:200]!r}")
        return 0, data
    return status, data


async def _load_one(
    proxy: Proxy, up: Upstream, path: str, body: bytes, deadline: float
) -> tuple[str, int, bytes]:
    """Load on one replica, waiting while storage lags: (ok, lagging, rejected or unreachable,
    its last status, its last answer)."""
    loop, cfg = proxy.loop, proxy.config
    last = (0, b"")

    async def attempt() -> tuple[str, int, bytes] | None:
        nonlocal last
        timeout_s = min(cfg.broadcast_timeout_s, max(deadline - loop.time(), 1))
        last = status, data = await _call(proxy, up, path, body, timeout_s)
        if status in (0, 200):
            return ("ok" if status else "unreachable"), status, data
        if path == api.PLUGIN_LOAD_PATH and api.already_loaded(status, data):
            # A plugin load's name is the version its URI names, and a version is never
            # rewritten: the replica serves these weights already (a load sent again after the
            # proxy that sent it first died with its answer, or after a trainer restart).
            return "ok", 200, b"Success: the LoRA adapter was loaded already."
        if not api.adapter_not_there_yet(status, data):
            return "rejected", status, data
        return None  # lagging: again, until the deadline

    timeout_s = deadline - loop.time()
    every = cfg.load_retry_interval_s
    done = await poll_until(
        attempt, every=every, timeout_s=timeout_s, clock=loop.time, sleep=asyncio.sleep
    )
    return done or ("lagging", *last)


async def load(proxy: Proxy, method: str, target: str, body: bytes) -> Response:
    cfg, pool, stats = proxy.config, proxy.pool, proxy.stats
    path = target.partition("?")[0]  # the query is not replayed
    try:
        parsed = decode_object(body, CONTROL_MAX_BODY)
    except BodyError as exc:
        return error_answer(exc.status, str(exc))
    if why := _load_refusal(path, parsed, cfg.lora_roots):
        stats.broadcasts["load", "forbidden"] += 1
        return error_answer(400, why)
    async with pool.fleet_lock:
        return await _load_fleet(proxy, path, body, parsed["lora_name"])


async def _load_fleet(proxy: Proxy, path: str, body: bytes, name: str) -> Response:
    cfg, pool, stats = proxy.config, proxy.pool, proxy.stats
    targets = pool.targets()
    if not targets:
        return error_answer(503, _NONE)
    deadline = proxy.loop.time() + cfg.load_deadline_s
    results = await asyncio.gather(*(_load_one(proxy, u, path, body, deadline) for u in targets))
    out: dict[str, list[tuple[Upstream, int, bytes]]] = {}
    for up, (kind, status, data) in zip(targets, results, strict=True):
        out.setdefault(kind, []).append((up, status, data))
    ok, rejected, lagging = (out.get(k, []) for k in ("ok", "rejected", "lagging"))
    if ok and not rejected and not lagging:
        pool.adapters[name] = (path, body)
        for up, _, _ in ok:
            up.adapters[name] = path
        stats.broadcasts["load", "ok"] += 1
        log.info("adapter %s loaded on %d replicas", name, len(ok))
        return 200, [(b"Content-Type", b"text/plain")], ok[0][2]
    # all or nothing: take it back from those that accepted; a replica that could not be
    # reached may still load it, and unloads it when it returns
    pool.retire(name, path)
    if ok:
        unload = json.dumps({"lora_name": name}).encode()
        await asyncio.gather(*(_call(proxy, up, api.unload_path(path), unload) for up, _, _ in ok))
    if rejected:
        up, status, data = rejected[0]
        stats.broadcasts["load", "rejected"] += 1
        log.warning(
            "adapter %s rejected by %s (HTTP %d); rolled back on %d replicas",
            name,
            up.url,
            status,
            len(ok),
        )
        return status, [(b"Content-Type", b"application/json"), (REPLICA_HEADER_B, up.url_b)], data
    if lagging:
        stats.broadcasts["load", "deadline"] += 1
        return error_answer(
            504,
            f"adapter {name} not found on {[r[0].url for r in lagging]} within "
            f"load_deadline_s={cfg.load_deadline_s}: storage has not caught up; rolled back",
        )
    stats.broadcasts["load", "unreachable"] += 1
    return error_answer(503, "no replica could be reached")


async def _post_all(proxy: Proxy, path_qs: str, body: bytes) -> list[tuple[Upstream, int, bytes]]:
    targets = proxy.pool.targets()
    answers = await asyncio.gather(*(_call(proxy, u, path_qs, body or None) for u in targets))
    return [(up, status, data) for up, (status, data) in zip(targets, answers, strict=True)]


async def unload(proxy: Proxy, method: str, target: str, body: bytes) -> Response:
    """Every replica; 200 if any unloaded it, 404 if none knew it."""
    path = target.partition("?")[0]
    try:
        name = decode_object(body, CONTROL_MAX_BODY).get("lora_name")
    except BodyError:
        name = None
    if not isinstance(name, str):
        return error_answer(400, 'body must be {"lora_name": NAME}')
    async with proxy.pool.fleet_lock:
        proxy.pool.retire(name)
        results = await _post_all(proxy, path, body)
    for up, status, _ in results:
        if status in (200, 404):
            up.adapters.pop(name, None)
    if not results:
        return error_answer(503, _NONE)
    if failed := [r for r in results if r[1] not in (0, 200, 404)]:
        up, status, data = failed[0]
        proxy.stats.broadcasts["unload", "failed"] += 1
        return status, [(REPLICA_HEADER_B, up.url_b)], data
    for status, outcome, kind in (
        (200, "ok", b"text/plain"),
        (404, "not_found", b"application/json"),
    ):
        if hit := [data for _, got, data in results if got == status]:
            proxy.stats.broadcasts["unload", outcome] += 1
            return status, [(b"Content-Type", kind)], hit[0]
    return error_answer(503, "no replica could be reached")


async def broadcast(proxy: Proxy, method: str, path_qs: str, body: bytes) -> Response:
    """/pause, /resume, /reset_prefix_cache: the fleet; 200 unless no replica is left or a live
    one refused (a replica leaving meanwhile catches up before it returns)."""
    path, _, query = path_qs.partition("?")
    pool = proxy.pool
    async with pool.fleet_lock:
        results = await _post_all(proxy, path_qs, body)
        agreed = [(up, data) for up, status, data in results if status == 200]
        failed = [
            {"url": up.url, "status": status, "body": data[:300].decode(errors="replace")}
            for up, status, data in results
            if status not in (0, 200)
        ]
        if agreed and not failed and path in (api.PAUSE_PATH, api.RESUME_PATH):
            pool.paused_query = ("?" + query if query else "") if path == api.PAUSE_PATH else None
        for up, _ in agreed:
            up.paused = path == api.PAUSE_PATH or (up.paused and path != api.RESUME_PATH)
    if not results:
        return error_answer(503, _NONE)
    if failed:
        proxy.stats.broadcasts[path.strip("/"), "failed"] += 1
        error = {"message": "a replica refused", "failed": failed, "code": 502}
        return json_answer(502, {"error": error})
    if not agreed:
        proxy.stats.broadcasts[path.strip("/"), "unreachable"] += 1
        return error_answer(503, "no replica could be reached")
    proxy.stats.broadcasts[path.strip("/"), "ok"] += 1
    return 200, [(b"Content-Type", b"application/json")], agreed[0][1]


async def fetch_info(proxy: Proxy, method: str, path: str, body: bytes) -> Response:
    """Every replica's adapter-plugin answer, so a trainer can check them all before a sync."""

    async def one(up: Upstream) -> list[dict[str, Any]]:
        try:
            status, data = await proxy.pool.call(up, "GET", api.PLUGIN_INFO_PATH)
        except OSError as exc:
            return [{"url": up.url, "status": 0, "body": f"{type(exc).__name__}: {exc}"}]
        return api.plugin_answers(up.url, status, data)  # another proxy: its replicas

    targets = proxy.pool.targets()
    if not targets:
        return error_answer(503, _NONE)
    answers = await asyncio.gather(*(one(u) for u in targets))
    return json_answer(200, {"replicas": [entry for answer in answers for entry in answer]})


async def health(proxy: Proxy, method: str, path: str, body: bytes) -> Response:
    """200 while at least ``min_healthy_replicas`` replicas serve (in the fleet and answering
    their own /health), else 503; the body names the others either way."""
    pool, need = proxy.pool, proxy.config.min_healthy_replicas
    ups = pool.in_rotation()
    results = await asyncio.gather(*(pool.probe(u) for u in ups))
    serving = sum(ok is True and u.serving for u, ok in zip(ups, results, strict=True))
    bad = [
        {"url": u.url, "circuit": u.circuit.value, "error": u.last_error}
        for u, ok in zip(ups, results, strict=True)
        if ok is not True or not u.serving
    ]
    doc = {
        "status": "ok" if serving >= need else "unhealthy",
        "replicas": len(ups),
        "serving": serving,
        "min_healthy_replicas": need,
        "unhealthy": bad,
    }
    return json_answer(200 if serving >= need else 503, doc)


async def stats(proxy: Proxy, method: str, path: str, body: bytes) -> Response:
    return json_answer(200, stats_json(proxy))


async def prometheus(proxy: Proxy, method: str, path: str, body: bytes) -> Response:
    return 200, [(b"Content-Type", CONTENT_TYPE_LATEST.encode())], render(proxy)


async def upstreams(proxy: Proxy, method: str, path: str, body: bytes) -> Response:
    """List (GET), add (POST ``{"url"}``) or remove (DELETE ``{"url"}``) a replica. A joining
    replica catches up first (:meth:`UpstreamPool.catch_up`): it enters the fleet holding every
    adapter loaded through the proxy, paused if the fleet is."""
    pool = proxy.pool
    if method == "GET":
        return json_answer(200, {"upstreams": [u.as_dict() for u in pool.upstreams.values()]})
    try:
        url = str(decode_object(body, CONTROL_MAX_BODY).get("url") or "").rstrip("/")
        if len(url) > MAX_URL:
            raise ValueError(f"a URL over {MAX_URL} characters")
        split_url(url)
    except (BodyError, ValueError) as exc:
        return error_answer(400, f'body must be {{"url": "http://HOST:PORT"}}: {exc}')
    if method == "DELETE":
        if pool.remove(url) is None:
            return error_answer(404, f"{url} is not an upstream")
        log.info("replica %s removed", url)
        return json_answer(200, {"removed": url})
    if url in pool.upstreams:
        return error_answer(400, f"{url} is already an upstream")
    up = pool.add(url, circuit=Circuit.JOINING)
    if error := await pool.catch_up(up, Circuit.CLOSED):
        if pool.upstreams.get(url) is up:
            pool.remove(url)
        return error_answer(502, f"{url} could not join: {error}")
    pool.fleet["joins"] += 1
    log.info("replica %s caught up and joined the fleet", url)
    return json_answer(200, {"added": url, "adapters": sorted(pool.adapters)})


def _weight(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and MIN_WEIGHT <= value <= MAX_WEIGHT else None  # type: ignore[operator]


async def runs_route(proxy: Proxy, method: str, target: str, body: bytes) -> Response:
    """List (GET), register (POST ``{"run", "lora_slots", "weight", "token"?}``: 409 naming
    ``--max-loras`` and the numbers when the runs would need more LoRA slots than the replicas
    hold) or release (DELETE ``{"run", "token"}``) the training runs sharing the replicas
    (:mod:`~asyncgrpo.proxy.runs`). A registration answers its token (the caller's own, or one
    drawn here); re-registering or releasing a registered run takes that token (403)."""
    runs = proxy.runs
    if method == "GET":
        return json_answer(200, runs_stats(proxy))
    try:
        doc = decode_object(body, CONTROL_MAX_BODY)
    except BodyError as exc:
        return error_answer(exc.status, str(exc))
    name, token = doc.get("run"), doc.get("token")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return error_answer(
            400,
            "body must name the run, printable ASCII without spaces, at "
            f'most {MAX_NAME} characters: {{"run": "<adapter prefix>", ...}}',
        )
    if token is not None and (not isinstance(token, str) or not TOKEN.fullmatch(token)):
        return error_answer(400, "token must be 16 to 256 printable ASCII characters")
    if why := booking_refusal(runs.runs.get(name), token):
        return error_answer(403, why)
    if method == "DELETE":
        if not runs.release(name):
            return error_answer(404, f"run {name} is not registered")
        log.info("run %s released its LoRA slots", name)
        return json_answer(200, {"released": name})
    return await _register(proxy, doc, name, token or secrets.token_urlsafe(24))


async def _register(proxy: Proxy, doc: dict[str, Any], name: str, token: str) -> Response:
    runs = proxy.runs
    slots, weight = doc.get("lora_slots"), _weight(doc.get("weight", 1.0))
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 1 << 16:
        return error_answer(400, "lora_slots must be an integer from 1 to 65536")
    if weight is None:
        return error_answer(400, f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}")
    said = await proxy.pool.settings()
    max_loras, max_seqs = said["max_loras"], said["max_num_seqs"]
    if max_loras is None:
        return error_answer(
            503, "no replica in rotation said its --max-loras (GET /server_info): is LoRA on?"
        )
    now = proxy.loop.time()
    if proxy.config.max_inflight_per_replica is None and max_seqs is not None:
        runs.per_replica = max_seqs
        runs.resize(len(proxy.pool.targets()), now)
    for lapsed in runs.expire(now):
        log.warning("run %s sent nothing for run_lease_s: its LoRA slots are free", lapsed)
    if why := booking_refusal(runs.runs.get(name), token):  # registered while we awaited
        return error_answer(403, why)
    why = runs.register(
        name,
        slots=slots,
        weight=weight,
        max_loras=max_loras,
        loaded=list(proxy.pool.adapters),
        now=now,
    )
    if why is not None:
        log.warning("refused: %s", why)
        return error_answer(409, why)
    runs.runs[name].token = token
    held = runs.holders(proxy.pool.adapters)
    log.info(
        "run %s holds %d LoRA slots (weight %g); %d of --max-loras %d held",
        name,
        slots,
        weight,
        sum(held.values()),
        max_loras,
    )
    return json_answer(
        200,
        {
            "run": name,
            "lora_slots": slots,
            "weight": weight,
            "token": token,
            "max_loras": max_loras,
            "lora_slots_held": held,
        },
    )


_BROADCAST = (api.PAUSE_PATH, api.RESUME_PATH, api.RESET_PREFIX_CACHE_PATH)

#: (method, path) -> handler; HEAD is answered as GET without the body.
ROUTES: dict[tuple[bytes, bytes], Handler] = {
    **{(b"POST", p.encode()): load for p in (api.LOAD_LORA_PATH, api.PLUGIN_LOAD_PATH)},
    **{(b"POST", p.encode()): unload for p in (api.UNLOAD_LORA_PATH, api.PLUGIN_UNLOAD_PATH)},
    **{(b"POST", p.encode()): broadcast for p in _BROADCAST},
    **{(m, UPSTREAMS_PATH.encode()): upstreams for m in (b"GET", b"POST", b"DELETE")},
    **{(m, RUNS_PATH.encode()): runs_route for m in (b"GET", b"POST", b"DELETE")},
    (b"GET", api.PLUGIN_INFO_PATH.encode()): fetch_info,
    (b"GET", api.HEALTH_PATH.encode()): health,
    (b"GET", api.METRICS_PATH.encode()): prometheus,
    (b"GET", STATS_PATH.encode()): stats,
}

"""A fault-injecting HTTP proxy in front of a storage server (moto, Azurite, fake-gcs-server).

Every request is forwarded to ``upstream`` unless a fault says otherwise:

- ``fail_next(n, status)``: the next ``n`` requests are answered ``status`` unforwarded;
- ``lose_answer_to(method, suffix)``: the next such request is forwarded (it takes effect),
  then answered 503 (its answer is lost);
- mode ``errors``: a seeded share of requests is answered one of ``statuses`` (500, 503);
- mode ``hang``: requests are read and never answered: clients time out, and retry;
- mode ``down``: storage is unreachable: open connections are dropped, and the process
  runner (:func:`serve_fault_proxy`) closes its port, so new ones are refused.

Why not toxiproxy: it is a TCP proxy (latency, resets, timeouts), with no way to answer an
HTTP status, and no Debian or PyPI package ships its server; a storage fault of the kind users
report (S3 answering 500 and 503 under load) is an HTTP answer. This proxy does both levels.

In a test: :func:`fault_app` served by any aiohttp runner (the transport suite serves it from a
thread). As a process, for benches whose roles are processes of their own::

    python -m asyncgrpo.testing.fault_proxy --upstream http://127.0.0.1:5000 --port 5001 \\
        --control-port 5002
    curl -X POST localhost:5002/fault -d '{"mode": "errors", "share": 0.3}'   # or hang, down, pass
    curl localhost:5002/stats

Loopback only: it forwards whatever reaches it, credentials included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["MODES", "Faults", "fault_app", "serve_fault_proxy"]

MODES = ("pass", "errors", "hang", "down")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-encoding", "host"}


@dataclass
class Faults:
    """The proxy's faults now, and what it did (shared by the app and whoever drives it)."""

    seed: int = 0
    mode: str = "pass"
    share: float = 0.0  #: mode ``errors``: the share of requests answered with an error
    statuses: tuple[int, ...] = (500, 503)
    requests: int = 0
    failed: int = 0  #: answered with an injected status
    hung: int = 0  #: held unanswered (mode ``hang``)
    dropped: int = 0  #: connections dropped (mode ``down``)
    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    _fail_next: int = 0
    _fail_status: int = 503
    _lose_answer_to: tuple[str, str] | None = None
    _changed: asyncio.Event | None = None
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def fail_next(self, n: int, status: int = 503) -> None:
        self._fail_next, self._fail_status = n, status

    def lose_answer_to(self, method: str, suffix: str) -> None:
        """Forward the next ``method`` request whose path ends with ``suffix``, then answer
        503 (the request took effect; its answer is lost)."""
        self._lose_answer_to = (method, suffix)

    def set_mode(
        self, mode: str, *, share: float = 0.0, statuses: Sequence[int] = (500, 503)
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share {share}: between 0 and 1")
        self.mode, self.share, self.statuses = mode, share, tuple(statuses)
        if self._changed is not None:  # wakes the requests held by ``hang``
            self._changed.set()
            self._changed = None

    def reset(self) -> None:
        self.set_mode("pass")
        self._fail_next, self.requests, self.failed = 0, 0, 0
        self.hung = self.dropped = 0
        self._lose_answer_to = None
        self.seen.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "share": self.share,
            "requests": self.requests,
            "failed": self.failed,
            "hung": self.hung,
            "dropped": self.dropped,
        }

    def _injected_status(self) -> int | None:
        if self._fail_next > 0:
            self._fail_next -= 1
            return self._fail_status
        if self.mode == "errors" and self._rng.random() < self.share:
            return self._rng.choice(self.statuses)
        return None

    async def _until_changed(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()


def _drop(request: web.Request) -> web.Response:
    """Close the client's connection without an answer (a reset, as from a dead host)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=503)  # never reaches the client


def fault_app(upstream: str, faults: Faults, *, strip_prefix: str = "") -> web.Application:
    """The proxy as an aiohttp application; ``strip_prefix`` is removed from request paths (the
    Hugging Face gateway's ``/<namespace>`` segment in front of moto)."""
    upstream = upstream.rstrip("/")
    session: aiohttp.ClientSession | None = None

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal session
        faults.requests += 1
        headers_seen = {k.lower(): v for k, v in request.headers.items()}
        faults.seen.append((request.method, request.rel_url.raw_path, headers_seen))
        del faults.seen[:-1000]  # bounded: a bench sends hundreds of thousands
        if faults.mode == "down":
            faults.dropped += 1
            return _drop(request)
        if faults.mode == "hang":
            faults.hung += 1
            await request.read()
            await faults._until_changed()
            return _drop(request)  # the client gave up long ago
        if (status := faults._injected_status()) is not None:
            faults.failed += 1
            await request.read()
            body = f"<Error><Code>Injected{status}</Code></Error>"
            return web.Response(status=status, text=body)
        path = request.rel_url.raw_path
        if strip_prefix and path.startswith(strip_prefix + "/"):
            path = path[len(strip_prefix) :]
        query = request.rel_url.raw_query_string
        target = upstream + path + (f"?{query}" if query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        data = await request.read()
        if session is None:
            session = aiohttp.ClientSession(auto_decompress=False)
        # Forward the signed headers untouched: Azure's SharedKey signs Content-Type and
        # Content-Length, so aiohttp must not add a Content-Type of its own.
        async with session.request(
            request.method,
            target,
            headers=headers,
            data=data or None,
            allow_redirects=False,
            skip_auto_headers=["Content-Type"],
        ) as up:
            payload = await up.read()
            lose = faults._lose_answer_to
            if lose is not None and request.method == lose[0] and path.endswith(lose[1]):
                faults._lose_answer_to = None
                faults.failed += 1
                return web.Response(status=503, text="<Error><Code>AnswerLost</Code></Error>")
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}
            if request.method == "HEAD":
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                await resp.write_eof()
                return resp
            out_headers.pop("Content-Length", None)
            return web.Response(status=up.status, headers=out_headers, body=payload)

    async def close_session(_: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_cleanup.append(close_session)
    return app


def _control_app(faults: Faults, on_mode: Any) -> web.Application:
    async def set_fault(request: web.Request) -> web.Response:
        """Change the mode; answers the counters as they stood under the mode it ends."""
        before = faults.stats()
        try:
            doc = json.loads(await request.read() or b"{}")
            faults.set_mode(
                str(doc.get("mode", "pass")),
                share=float(doc.get("share", 0.0)),
                statuses=[int(s) for s in doc.get("statuses", (500, 503))],
            )
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        await on_mode(faults.mode)
        return web.json_response(before)

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(faults.stats())

    app = web.Application()
    app.router.add_post("/fault", set_fault)
    app.router.add_get("/stats", stats)
    return app


async def serve_fault_proxy(
    upstream: str, port: int, control_port: int, *, seed: int = 0, host: str = "127.0.0.1"
) -> None:
    """Serve the proxy on ``port`` and its control on ``control_port`` until cancelled. Mode
    ``down`` closes ``port`` (connections refused) and drops the open connections."""
    faults = Faults(seed=seed)
    runner = web.AppRunner(fault_app(upstream, faults), access_log=None)
    await runner.setup()
    site: web.TCPSite | None = None

    async def listen() -> None:
        nonlocal site
        if site is None:
            site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()

    async def on_mode(mode: str) -> None:
        nonlocal site
        if mode == "down":
            if site is not None:
                await site.stop()
                site = None
            server = runner.server
            for handler in list(server.connections if server is not None else ()):
                handler.force_close()
                if handler.transport is not None:
                    handler.transport.abort()
        else:
            await listen()

    await listen()
    control = web.AppRunner(_control_app(faults, on_mode), access_log=None)
    await control.setup()
    await web.TCPSite(control, host, control_port).start()
    print(
        f"fault proxy on http://{host}:{port} -> {upstream} (control :{control_port})", flush=True
    )
    try:
        await asyncio.Event().wait()
    finally:
        await control.cleanup()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.testing.fault_proxy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--upstream", required=True, help="the storage server's base URL")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0, help="seeds which requests fail")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve_fault_proxy(args.upstream, args.port, args.control_port, seed=args.seed))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

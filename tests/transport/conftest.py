"""Real storage servers for the transport tests, all on 127.0.0.1.

* ``moto_endpoint``: moto's ``ThreadedMotoServer``, a real S3 protocol server (one per session).
* ``gateway``: a small aiohttp reverse proxy in front of moto, in its own thread and event loop.
  It strips a leading ``/testns`` path segment, which is how the Hugging Face S3 gateway
  addresses ``https://s3.hf.co/<namespace>/<bucket>/<key>``, and it injects faults: answer the
  next N requests with a status (503 for transient, 403 for permanent) without forwarding them.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BUCKET = "asyncgrpo-test"
NAMESPACE = "testns"
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-encoding", "host"}


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
    urllib.request.urlopen(request, timeout=10).read()
    try:
        yield endpoint
    finally:
        server.stop()


class FaultProxy:
    """Forward every request to ``upstream``; fail the next ``n`` ones on demand."""

    def __init__(self, upstream: str, strip_prefix: str) -> None:
        self.upstream = upstream
        self.strip_prefix = strip_prefix
        self.url = ""
        self.requests = 0
        self.failed = 0
        self._fail_next = 0
        self._fail_status = 503
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)

    def fail_next(self, n: int, status: int = 503) -> None:
        self._fail_next, self._fail_status = n, status

    def reset(self) -> None:
        self._fail_next, self.requests, self.failed = 0, 0, 0

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(auto_decompress=False)

        async def handle(request: web.Request) -> web.StreamResponse:
            self.requests += 1
            if self._fail_next > 0:
                self._fail_next -= 1
                self.failed += 1
                await request.read()
                body = f"<Error><Code>Injected{self._fail_status}</Code></Error>"
                return web.Response(status=self._fail_status, text=body)
            path = request.rel_url.raw_path
            if path.startswith(self.strip_prefix + "/"):
                path = path[len(self.strip_prefix) :]
            query = request.rel_url.raw_query_string
            target = self.upstream + path + (f"?{query}" if query else "")
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
            data = await request.read()
            async with session.request(
                request.method, target, headers=headers, data=data, allow_redirects=False
            ) as up:
                payload = await up.read()
                out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}
                if request.method == "HEAD":
                    resp = web.StreamResponse(status=up.status, headers=out_headers)
                    await resp.prepare(request)
                    await resp.write_eof()
                    return resp
                out_headers.pop("Content-Length", None)
                return web.Response(status=up.status, headers=out_headers, body=payload)

        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()


@pytest.fixture(scope="session")
def gateway(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint, strip_prefix=f"/{NAMESPACE}")
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def fault_proxy(gateway: FaultProxy) -> Iterator[FaultProxy]:
    gateway.reset()
    yield gateway
    gateway.reset()


def s3_options(**overrides: Any) -> dict[str, Any]:
    """Credentials moto accepts and a fast backoff, so retry tests take milliseconds."""
    return {
        "region": "us-east-1",
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
        "max_retries": 4,
        "retry_timeout_s": 10.0,
        **overrides,
    }


def make_transport(kind: str, tmp_path: Path, moto: str, gateway_url: str, **overrides: Any):
    """A fresh, empty transport of ``kind`` (unique prefix per call)."""
    from asyncgrpo.transport.hf import HFBucketTransport
    from asyncgrpo.transport.local import LocalTransport
    from asyncgrpo.transport.s3 import S3Transport

    prefix = f"t-{uuid.uuid4().hex[:10]}"
    if kind == "local":
        return LocalTransport(tmp_path / "store" / prefix)
    if kind == "s3":
        return S3Transport(BUCKET, prefix, endpoint=moto, **s3_options(**overrides))
    if kind == "s3-proxy":
        return S3Transport(BUCKET, prefix, endpoint=gateway_url, **s3_options(**overrides))
    if kind == "hf":
        opts = s3_options(**overrides)
        opts.pop("region")
        return HFBucketTransport(NAMESPACE, BUCKET, prefix, endpoint=gateway_url, **opts)
    raise ValueError(kind)


@pytest.fixture(params=["local", "s3", "hf"])
def transport(request: pytest.FixtureRequest, tmp_path: Path, moto_endpoint: str, gateway):
    return make_transport(request.param, tmp_path, moto_endpoint, gateway.url)


@pytest.fixture
def transport_factory(tmp_path: Path, moto_endpoint: str, gateway):
    def factory(kind: str, **overrides: Any):
        return make_transport(kind, tmp_path, moto_endpoint, gateway.url, **overrides)

    return factory

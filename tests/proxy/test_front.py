"""The proxy's HTTP/1.1 front over raw sockets, in front of a real aiohttp upstream.

The upstream echoes what it received (body and the headers that matter), so each test can see
exactly what the proxy forwarded. The vLLM-backed tests (test_proxy_vllm.py) cover the same
front with real replicas; these pin down the HTTP corners a client library rarely exercises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.proxy.http.headers import REPLICA_HEADER
from asyncgrpo.testing.vllm_metrics import samples

pytestmark = pytest.mark.anyio
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def anyio_backend(both_loops: object) -> object:
    return both_loops


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, dict]]:
    """A real aiohttp server standing in for a replica; yields (url, shared state)."""
    state: dict = {"release": asyncio.Event(), "seen": [], "held": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state["seen"].append(dict(request.headers))
        parsed = json.loads(body)
        if parsed.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"n": 1}\n\n')
            await state["release"].wait()  # the test reads chunk 1 before chunk 2 exists
            await out.write(b'data: {"n": 2}\n\ndata: [DONE]\n\n')
            await out.write_eof()
            return out
        if parsed.get("hold"):
            state["held"] += 1
            await state["release"].wait()
        return web.json_response({"echo": parsed, "length": len(body)})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"vllm_config": {"cache_config": {"block_size": 16}}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", state
    finally:
        await runner.cleanup()


def _config(url: str, **kw: object) -> ProxyConfig:
    return ProxyConfig(upstreams=(url,), port=0, **kw)  # type: ignore[arg-type]


async def _replica(
    completions: Callable[[web.Request], Awaitable[web.StreamResponse]],
    *,
    prefix: str = "",
    tls: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, str]:
    """A stand-in replica: ``completions`` and an always-healthy ``/health`` under ``prefix``."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post(prefix + "/v1/completions", completions)
    app.router.add_get(prefix + "/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    scheme = "https://localhost" if tls else "http://127.0.0.1"
    return runner, f"{scheme}:{runner.addresses[0][1]}{prefix}"


async def _raw(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(head[0].split()[1]), headers, body


def _post(body: bytes, extra: str = "", path: str = "/v1/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def test_pipelined_requests_answer_in_order_on_one_connection(upstream) -> None:
    url, _ = upstream
    async with serve_proxy(_config(url)) as base:
        reader, writer = await _raw(base)
        bodies = [json.dumps({"model": "m", "prompt": [i] * 40}).encode() for i in range(3)]
        writer.write(b"".join(_post(b) for b in bodies))  # all three in one segment
        for i in range(3):
            status, headers, body = await _response(reader)
            assert status == 200
            assert json.loads(body)["echo"]["prompt"][0] == i
            assert headers[REPLICA_HEADER.lower()] == url
            assert "date" in headers and "connection" not in headers
        writer.close()


async def test_expect_continue_and_chunked_request_body(upstream) -> None:
    url, _ = upstream
    payload = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()
    async with serve_proxy(_config(url)) as base:
        reader, writer = await _raw(base)
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nExpect: 100-continue\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(head.encode())
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        for i in range(0, len(payload), 100):
            part = payload[i : i + 100]
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        writer.write(b"0\r\n\r\n")
        status, _, body = await _response(reader)
        assert status == 200
        assert json.loads(body)["length"] == len(payload)  # forwarded de-chunked, whole
        writer.close()


async def test_bad_heads_and_bodies_get_clear_errors_and_close(upstream) -> None:
    url, _ = upstream
    cases = [
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"POST /v1/completions HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed header"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 9999\r\n\r\n", 413, "too large"),
        (
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            400,
            "both Content-Length",
        ),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431, "head over"),
    ]
    async with serve_proxy(_config(url, max_body_bytes=2048)) as base:
        for raw, status, message in cases:
            reader, writer = await _raw(base)
            writer.write(raw)
            got, headers, body = await _response(reader)
            assert got == status, body
            assert message in json.loads(body)["error"]["message"]
            assert headers["connection"] == "close"
            assert await reader.read() == b""  # and the proxy closed the connection
            writer.close()
        async with aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", data=b"{not json", headers=JSON) as r:
                assert r.status == 400
                assert "not valid JSON" in (await r.json())["error"]["message"]
            async with s.get(base + "/proxy/stats") as r:
                rejected = (await r.json())["rejected"]
        assert {int(k): v for k, v in rejected.items()} == {400: 4, 413: 1, 431: 1}


async def test_api_key_checked_on_every_path_and_never_forwarded(upstream) -> None:
    url, state = upstream
    cfg = _config(url, api_key="sekrit-in", upstream_api_key="sekrit-out")
    body = {"model": "m", "prompt": "hi"}
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            async with s.request(method, base + path, json=body) as r:
                assert r.status == 401
            wrong = {"Authorization": "Bearer nope"}
            async with s.request(method, base + path, json=body, headers=wrong) as r:
                assert r.status == 401
        good = {"Authorization": "Bearer sekrit-in"}
        async with s.post(base + "/v1/completions", json=body, headers=good) as r:
            assert r.status == 200
        async with s.get(base + "/v1/models", headers=good) as r:
            assert (await r.json())["data"][0]["id"] == "m"
    assert state["seen"] and all(h["Authorization"] == "Bearer sekrit-out" for h in state["seen"])


async def test_stream_is_relayed_as_it_arrives_and_connection_kept(upstream) -> None:
    url, state = upstream
    async with serve_proxy(_config(url)) as base:
        reader, writer = await _raw(base)
        writer.write(_post(json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
        size = int(await reader.readuntil(b"\r\n"), 16)
        first = await asyncio.wait_for(reader.readexactly(size + 2), 10)
        assert first == b'data: {"n": 1}\n\n\r\n'  # before the upstream has written chunk 2
        state["release"].set()
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await asyncio.wait_for(reader.read(1024), 10)
        assert b"[DONE]" in rest
        writer.write(_post(json.dumps({"model": "m", "prompt": "again"}).encode()))
        status, _, body = await _response(reader)  # same connection, after a relayed stream
        assert status == 200 and json.loads(body)["echo"]["prompt"] == "again"
        writer.close()


async def test_shutdown_with_idle_and_busy_connections_leaves_nothing(upstream, caplog) -> None:
    url, state = upstream

    def ours() -> set[str]:
        return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("asyncgrpo-proxy-")}

    before = ours()
    async with serve_proxy(_config(url)) as base:
        assert ours() == before  # one server: no private socket directory any more
        idle = await _raw(base)
        busy = await _raw(base)
        busy[1].write(_post(json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()))
        await busy[0].readuntil(b"\r\n\r\n")
    # Both connections are closed by the proxy (the stream cut short).
    assert await asyncio.wait_for(idle[0].read(), 5) == b""
    await asyncio.wait_for(busy[0].read(), 5)
    assert busy[0].at_eof()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    state["release"].set()


async def test_idle_and_trickling_clients_are_disconnected(upstream) -> None:
    url, _ = upstream
    async with serve_proxy(_config(url, client_idle_timeout_s=0.4, head_timeout_s=0.4)) as base:
        trickle = await _raw(base)
        trickle[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # never finished
        idle = await _raw(base)
        idle[1].write(_post(json.dumps({"model": "m", "prompt": "x"}).encode()))
        assert (await _response(idle[0]))[0] == 200
        busy = await _raw(base)
        for _ in range(8):  # a client that keeps sending requests is not cut off
            busy[1].write(_post(json.dumps({"model": "m", "prompt": "y"}).encode()))
            assert (await _response(busy[0]))[0] == 200
            await asyncio.sleep(0.1)
        assert await asyncio.wait_for(trickle[0].read(), 5) == b""
        assert await asyncio.wait_for(idle[0].read(), 5) == b""
        for _, w in (trickle, idle, busy):
            w.close()


async def test_a_replica_past_the_deadline_is_given_up(upstream) -> None:
    """A held completion ends at ``request_timeout_s`` (not before): a 503 naming the timeout."""
    url, state = upstream
    body = json.dumps({"model": "m", "prompt": [1] * 40, "hold": True}).encode()
    cfg = _config(url, request_timeout_s=0.3, max_attempts=1)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        try:
            async with s.post(base + "/v1/completions", data=body, headers=JSON) as r:
                took = time.monotonic() - t0
                assert r.status == 503
                assert "TimeoutError" in (await r.json())["error"]["message"]
        finally:
            state["release"].set()
    assert 0.3 <= took < 10


async def test_client_gone_mid_request_frees_the_replica_slot(upstream) -> None:
    """A client that disconnects while its completion runs: the proxy drops the upstream
    request (vLLM aborts a request whose connection closes) and stops counting it in flight."""
    url, state = upstream
    async with serve_proxy(_config(url)) as base, aiohttp.ClientSession() as s:
        _, writer = await _raw(base)
        writer.write(_post(json.dumps({"model": "m", "prompt": [1] * 40, "hold": True}).encode()))
        for _ in range(100):
            if state["held"]:
                break
            await asyncio.sleep(0.05)
        async with s.get(base + "/proxy/stats") as r:
            assert (await r.json())["routing"]["inflight"][url] == 1
        writer.close()
        try:
            for _ in range(100):
                async with s.get(base + "/proxy/stats") as r:
                    stats = await r.json()
                if stats["routing"]["inflight"][url] == 0:
                    break
                await asyncio.sleep(0.05)
            assert stats["routing"]["inflight"][url] == 0
        finally:
            state["release"].set()
        body = json.dumps({"model": "m", "prompt": [1] * 40}).encode()
        async with s.post(
            base + "/v1/completions", data=body, headers=JSON
        ) as r:  # the proxy still serves
            assert r.status == 200


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for localhost / 127.0.0.1 and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_https_replica_under_a_path_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ``https://`` replica (a Hugging Face Job's exposed URL, say) behind a path prefix:
    the same pooled client over TLS, its certificate verified, for generation (buffered and
    streamed) and control calls alike."""
    cert, key = _self_signed(tmp_path)
    seen: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization", ""))
        parsed = await request.json()
        if not parsed.get("stream"):
            return web.json_response({"echo": parsed["prompt"], "tls": request.secure})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            await out.write(part)
        await out.write_eof()
        return out

    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    runner, url = await _replica(completions, prefix="/job", tls=tls)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust it as the system's CAs are trusted
    try:
        cfg = _config(url, block_size=16, upstream_api_key="hf_secret")
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "over tls"}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200 and await r.json() == {"echo": "over tls", "tls": True}
                assert r.headers[REPLICA_HEADER] == url
            async with s.post(base + "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status == 200 and await r.read() == b"data: 1\n\ndata: [DONE]\n\n"
            async with s.get(base + "/health") as r:
                assert r.status == 200, await r.text()
        assert seen == ["Bearer hf_secret"] * 2
        # Without the certificate trusted, the replica cannot be reached: no request goes out.
        monkeypatch.delenv("SSL_CERT_FILE")
        async with serve_proxy(_config(url, block_size=16)) as base, aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 503
            async with s.get(base + "/health") as r:
                assert r.status == 503 and "CERTIFICATE_VERIFY_FAILED" in await r.text()
        assert len(seen) == 2
    finally:
        await runner.cleanup()


async def test_stream_retried_until_its_first_chunk_then_cut_short(upstream) -> None:
    """A replica failing a stream before its first chunk (a 500, or a close) costs the client
    nothing: another replica serves it. One failing after the first chunk cuts the client's
    answer short: it has part of an answer, which no retry could complete."""
    url, state = upstream
    mode = {"fail": "500"}

    async def flaky(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode["fail"] == "500":
            return web.Response(status=500, text="EngineDeadError")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if mode["fail"] == "midway":
            await out.write(b'data: {"n": 1}\n\n')
            await asyncio.sleep(0.1)
        request.transport.close()  # no chunk (or one), then the connection drops
        return out

    runner, bad = await _replica(flaky)
    state["release"].set()  # the good replica streams both chunks at once
    body = {"model": "m", "prompt": [7] * 40, "stream": True}
    try:
        for fail in ("500", "close"):
            mode["fail"] = fail
            cfg = ProxyConfig(upstreams=(bad, url), port=0, block_size=16, routing="round_robin")
            async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
                for _ in range(2):  # round-robin: one of them starts on the bad replica
                    async with s.post(base + "/v1/completions", json=body) as r:
                        assert r.status == 200 and r.headers[REPLICA_HEADER] == url
                        assert (await r.read()).endswith(b"data: [DONE]\n\n")
        mode["fail"] = "midway"
        cfg = ProxyConfig(upstreams=(bad,), port=0, block_size=16)
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
    finally:
        await runner.cleanup()


async def test_a_failing_replica_hands_its_requests_in_flight_to_another() -> None:
    """A 5xx takes a replica out of rotation and ends every request still waiting on it now
    (a vLLM engine that died leaves its HTTP server up): they are retried elsewhere."""
    held, two_waiting = asyncio.Event(), asyncio.Event()
    waiting: list[int] = []

    async def dying(request: web.Request) -> web.Response:
        parsed = await request.json()
        if parsed.get("hold"):
            waiting.append(1)
            if len(waiting) == 2:
                two_waiting.set()
            await held.wait()  # set only at the end: only the proxy can end these
        return web.Response(status=500, text="EngineDeadError")

    async def fine(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    runners, urls = zip(*[await _replica(handler) for handler in (dying, fine)], strict=True)
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, block_size=16, routing="round_robin")
    timeout = aiohttp.ClientTimeout(total=60)  # a request left hanging fails in a minute
    try:
        async with serve_proxy(cfg) as base, aiohttp.ClientSession(timeout=timeout) as s:

            async def post(body: dict) -> tuple[int, str]:
                async with s.post(base + "/v1/completions", json=body) as r:
                    return r.status, r.headers.get(REPLICA_HEADER, "")

            holds = [asyncio.create_task(post({"prompt": "x", "hold": True})) for _ in range(4)]
            await two_waiting.wait()  # two on each replica; the fine one answered its two
            t0 = time.monotonic()
            assert {await post({"prompt": "y"}) for _ in range(2)} == {(200, urls[1])}
            assert [await h for h in holds] == [(200, urls[1])] * 4
            assert time.monotonic() - t0 < 5  # not request_timeout_s (600 s)
            async with s.get(base + "/proxy/stats") as r:
                dead = next(u for u in (await r.json())["upstreams"] if u["url"] == urls[0])
            assert dead["circuit"] == "open" and dead["failures"]["http_500"] == 1
    finally:
        held.set()
        for runner in runners:
            await runner.cleanup()


class _Transport:
    """What a client connection needs of its transport, recording reads paused and writes."""

    def __init__(self) -> None:
        self.paused, self.written, self.closing = False, b"", False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def test_a_client_pipelining_without_reading_holds_at_most_two_bodies(upstream) -> None:
    """While one request is answered, queued requests and a partial one are read only up to
    ``max_body_bytes`` in all: a connection holds about twice that, however much is sent."""
    from asyncgrpo.proxy.front import Clients, Connection
    from asyncgrpo.proxy.state import Proxy

    url, state = upstream
    limit = 100_000
    proxy = Proxy(_config(url, max_body_bytes=limit, block_size=16), asyncio.get_running_loop())
    clients = Clients(proxy, cap=8)
    conn, transport = Connection(clients), _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    try:
        held = json.dumps({"model": "m", "prompt": [1] * 40, "hold": True}).encode()
        conn.data_received(_post(held))
        body = json.dumps({"model": "m", "prompt": "x" * 30_000}).encode()
        sent = 0
        for piece in (_post(body)[i : i + 8192] for _ in range(40) for i in range(0, 30_200, 8192)):
            if transport.paused:
                break
            conn.data_received(piece)
            sent += len(piece)
        assert transport.paused and conn.current is not None
        partial = conn.req.size if conn.in_message else 0
        assert limit <= conn.queued_bytes + partial < limit + len(body) + 8192
        assert sent < 3 * limit  # 40 requests were offered: 1.2 MB
        state["release"].set()
        for _ in range(100):  # the held answer, then the queue drains and reading resumes
            if not transport.paused:
                break
            await asyncio.sleep(0.05)
        assert not transport.paused
    finally:
        state["release"].set()
        clients.close()
        proxy.pool.close()


async def test_x_session_id_keeps_an_episodes_turns_on_one_replica() -> None:
    """Each turn's prompt is the previous turn's whole sequence plus more; with the same
    ``X-Session-ID`` every later turn goes where the first went, counted in /proxy/stats and
    /metrics."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    runners, urls = zip(*[await _replica(ok) for _ in range(3)], strict=True)
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, block_size=4)
    try:
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
            where: dict[int, set[str]] = {}
            for turn in range(3):
                for e in range(6):
                    ids = [7] * 8 + [e * 100 + k for k in range(6 + 5 * turn)]
                    async with s.post(
                        base + "/v1/completions",
                        headers={"X-Session-ID": f"g{e}"},
                        json={"model": "m", "prompt": ids},
                    ) as r:
                        assert r.status == 200
                        where.setdefault(e, set()).add(r.headers[REPLICA_HEADER])
            async with s.get(base + "/proxy/stats") as r:
                routing = (await r.json())["routing"]
            async with s.get(base + "/metrics") as r:
                metrics = await r.text()
        assert all(len(replicas) == 1 for replicas in where.values()), where
        assert len(set.union(*where.values())) == 3  # the episodes are spread all the same
        assert routing["decisions"]["session"] == 12 and routing["tracked_sessions"] == 6
        m = samples(metrics)
        assert m['asyncgrpo_proxy_route_decisions_total{kind="session"}'] == 12
        assert m["asyncgrpo_proxy_tracked_sessions"] == 6
    finally:
        for runner in runners:
            await runner.cleanup()

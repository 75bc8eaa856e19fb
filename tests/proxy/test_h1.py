"""The proxy's raw keep-alive HTTP/1.1 client against a real aiohttp server."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from asyncgrpo.proxy.h1 import ConnectFailed, Disconnected, H1Pool

pytestmark = pytest.mark.anyio


async def _server(app: web.Application, **kwargs: object) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def _app(peers: list[object]) -> web.Application:
    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))
        body = await request.read()
        if request.query.get("chunked"):
            out = web.StreamResponse(headers={"X-Kind": "chunked"})
            out.enable_chunked_encoding()
            await out.prepare(request)
            for i in range(0, len(body), 3):
                await out.write(body[i : i + 3])
            await out.write_eof()
            return out
        if request.query.get("close"):
            return web.Response(body=body, headers={"Connection": "close"})
        status = int(request.query.get("status", "200"))
        return web.Response(
            body=body, status=status, headers={"X-Seen": request.headers.get("X-Test", "")}
        )

    app = web.Application()
    app.router.add_post("/echo", echo)
    return app


async def test_keepalive_reuse_chunked_and_status() -> None:
    peers: list[object] = []
    runner, port = await _server(_app(peers))
    pool = H1Pool("127.0.0.1", port)
    try:
        status, headers, data = await pool.post("/echo", [("X-Test", "a")], b'{"x": 1}')
        assert (status, data, dict(headers)["X-Seen"]) == (200, b'{"x": 1}', "a")
        status, _, data = await pool.post("/echo?status=503", [], b"boom")
        assert (status, data) == (503, b"boom")
        status, headers, data = await pool.post("/echo?chunked=1", [], b"0123456789")
        assert (status, data, dict(headers)["X-Kind"]) == (200, b"0123456789", "chunked")
        assert len(set(peers)) == 1  # one connection, kept alive
        await pool.post("/echo?close=1", [], b"bye")
        await pool.post("/echo", [], b"again")
        assert len(set(peers)) == 2  # "Connection: close" was honoured
    finally:
        pool.close()
        await runner.cleanup()


async def test_idle_connection_closed_by_server_is_retried_fresh() -> None:
    peers: list[object] = []
    runner, port = await _server(_app(peers), keepalive_timeout=0.1)
    pool = H1Pool("127.0.0.1", port, keepalive_s=60)
    try:
        await pool.post("/echo", [], b"1")
        await asyncio.sleep(0.4)  # the server closes the idle connection
        status, _, data = await pool.post("/echo", [], b"2")
        assert (status, data) == (200, b"2")
        assert len(set(peers)) == 2
    finally:
        pool.close()
        await runner.cleanup()


async def test_refused_and_cut_short() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectFailed):
        await H1Pool("127.0.0.1", port).post("/x", [], b"")

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(Disconnected, match="cut short"):
            await H1Pool("127.0.0.1", port).post("/x", [], b"")
    finally:
        server.close()
        await server.wait_closed()

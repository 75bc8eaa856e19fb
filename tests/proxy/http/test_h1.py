"""The proxy's raw keep-alive HTTP/1.1 client against a real aiohttp server, and its parser."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from asyncgrpo.proxy.http.h1 import ConnectFailed, Disconnected, Exchange, H1Pool, Response, _Conn


class _Waiter(Exchange):
    __slots__ = ("fut",)

    def __init__(self) -> None:
        super().__init__()
        self.fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()

    def on_response(self, response: Response) -> None:
        self.fut.set_result(response)

    def on_error(self, exc: OSError) -> None:
        self.fut.set_exception(exc)


async def _post(pool: H1Pool, path: str, headers: list[tuple[str, str]], body: bytes) -> Response:
    """POST ``body`` on ``pool`` and wait for the answer."""
    waiter = _Waiter()
    lines = b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
    pool.send(waiter, pool.request(b"POST", path.encode(), lines, body))
    return await waiter.fut


class ResponseParser(Exchange):
    """A pooled connection's answer parsing without a socket: :meth:`feed` returns
    ``(response, reusable)`` once the answer is complete, :meth:`eof` is the connection's close;
    both raise what the exchange would get as its error."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = H1Pool("http://localhost")
        self.c = _Conn(self.pool)
        self.c.start(self, b"", head_request=False)
        self.outcome: Response | OSError | None = None

    def on_response(self, response: Response) -> None:
        self.outcome = response

    def on_error(self, exc: OSError) -> None:
        self.outcome = exc

    def _result(self) -> Response | None:
        if isinstance(self.outcome, OSError):
            raise self.outcome
        return self.outcome

    def feed(self, data: bytes) -> tuple[Response, bool] | None:
        self.c.data_received(data)
        response = self._result()
        return None if response is None else (response, self.c in self.pool.idle)

    def eof(self) -> Response | None:
        self.c.connection_lost(None)
        return self._result()


def _feed_bytewise(parser: ResponseParser, raw: bytes) -> list[object]:
    """Feed one byte at a time; the results of every call that completed the answer."""
    return [done for i in range(len(raw)) if (done := parser.feed(raw[i : i + 1])) is not None]


def test_parser_any_segmentation() -> None:
    chunked = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n"
        b"3;ext=1\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    sized = b"HTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nnope!"
    for raw, want in ((chunked, (200, b"abc0123456789abcdef")), (sized, (404, b"nope!"))):
        whole = ResponseParser().feed(raw)
        assert whole is not None and whole[1] is True
        assert (whole[0][0], whole[0][2]) == want
        assert _feed_bytewise(ResponseParser(), raw) == [whole]  # complete once, at the last byte
    assert ResponseParser().feed(chunked[:-1]) is None


def test_parser_keepalive_close_delimited_and_errors() -> None:
    done = ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxEXTRA")
    assert done is not None and done[1] is False  # bytes nobody asked for: do not reuse
    done = ResponseParser().feed(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    assert done is not None and done[1] is False
    done = ResponseParser().feed(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert done is not None and done[1] is False  # HTTP/1.0 without keep-alive
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\n\r\nuntil ") is None
    assert p.feed(b"the close") is None
    assert p.eof() == (200, [], b"until the close")
    with pytest.raises(Disconnected, match="before the answer"):
        ResponseParser().eof()
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort")
    with pytest.raises(Disconnected, match="cut short"):
        p.eof()
    for bad in (
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 2xx OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ):
        with pytest.raises(Disconnected):
            ResponseParser().feed(bad)


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend(both_loops: object) -> object:
    return both_loops


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
    pool = H1Pool(f"http://127.0.0.1:{port}")
    try:
        status, headers, data = await _post(pool, "/echo", [("X-Test", "a")], b'{"x": 1}')
        assert (status, data, dict(headers)[b"X-Seen"]) == (200, b'{"x": 1}', b"a")
        status, _, data = await _post(pool, "/echo?status=503", [], b"boom")
        assert (status, data) == (503, b"boom")
        status, headers, data = await _post(pool, "/echo?chunked=1", [], b"0123456789")
        assert (status, data, dict(headers)[b"X-Kind"]) == (200, b"0123456789", b"chunked")
        assert len(set(peers)) == 1  # one connection, kept alive
        await _post(pool, "/echo?close=1", [], b"bye")
        await _post(pool, "/echo", [], b"again")
        assert len(set(peers)) == 2  # "Connection: close" was honoured
    finally:
        pool.close()
        await runner.cleanup()


async def test_idle_connection_closed_by_server_is_retried_fresh() -> None:
    peers: list[object] = []
    runner, port = await _server(_app(peers), keepalive_timeout=0.1)
    pool = H1Pool(f"http://127.0.0.1:{port}", keepalive_s=60)
    try:
        await _post(pool, "/echo", [], b"1")
        await asyncio.sleep(0.4)  # the server closes the idle connection
        status, _, data = await _post(pool, "/echo", [], b"2")
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
        await _post(H1Pool(f"http://127.0.0.1:{port}"), "/x", [], b"")

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(Disconnected, match="cut short"):
            await _post(H1Pool(f"http://127.0.0.1:{port}"), "/x", [], b"")
    finally:
        server.close()
        await server.wait_closed()

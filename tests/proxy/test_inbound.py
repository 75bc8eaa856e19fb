"""The front's rules on top of llhttp, checked directly (no sockets): each refusal says why."""

from __future__ import annotations

import httptools
import pytest

from asyncgrpo.proxy.inbound import Refused, Request, check_head, refusal


def _req(*headers: tuple[bytes, bytes], method: bytes = b"POST") -> Request:
    req = Request()
    req.method = method
    for name, value in headers:
        req.headers.append((name, value))
    return req


HOST = (b"Host", b"proxy")


@pytest.mark.parametrize(
    ("req", "version", "status", "message"),
    [
        (_req(HOST), "2.0", 505, "HTTP/2.0 is not supported"),
        (_req(HOST), "0.9", 505, "only HTTP/1.0 and 1.1"),
        (_req(HOST, method=b"CONNECT"), "1.1", 405, "CONNECT"),
        (_req(HOST, (b"Transfer-Encoding", b"gzip, chunked")), "1.1", 501, "only chunked"),
        (_req(HOST, (b"Transfer-Encoding", b"chunked")), "1.0", 400, "HTTP/1.0"),
        (_req(HOST, (b"Content-Length", b"2049")), "1.1", 413, "2049 bytes > 2048"),
        (_req(), "1.1", 400, "exactly one Host"),
        (_req(HOST, HOST), "1.1", 400, "exactly one Host"),
        (_req(HOST), "1.1", 401, "Authorization: Bearer"),
        (_req(HOST, (b"Authorization", b"Bearer k"), (b"Expect", b"x")), "1.1", 417, "Expect"),
    ],
)
def test_refused_heads(req: Request, version: str, status: int, message: str) -> None:
    auth = b"Bearer k" if status in (401, 417) else None
    with pytest.raises(Refused, match=message) as info:
        check_head(req, version, 2048, auth)
    assert info.value.status == status


def test_accepted_heads() -> None:
    chunked = _req(HOST, (b"Transfer-Encoding", b"Chunked"), (b"Expect", b"100-Continue"))
    check_head(chunked, "1.1", 2048, None)
    check_head(_req(), "1.0", 2048, None)  # HTTP/1.0 needs no Host
    check_head(_req(HOST, (b"Authorization", b"Bearer k")), "1.1", 2048, b"Bearer k")


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed header"),
        (b"GET / HTTP/1.1\r\nX: a\x00\r\n\r\n", 400, "malformed header"),
        (b"GET / HTTP/1.7\r\n\r\n", 505, "HTTP version"),
        (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
         "both Content-Length and Transfer-Encoding"),
    ],
)  # fmt: skip
def test_llhttp_refusals_are_named(raw: bytes, status: int, message: str) -> None:
    class Sink:
        in_head = True

        def on_headers_complete(self) -> None:
            self.in_head = False

    sink = Sink()
    with pytest.raises(httptools.HttpParserError) as info:
        httptools.HttpRequestParser(sink).feed_data(raw)
    got = refusal(info.value, sink.in_head)
    assert got.status == status and message in str(got)

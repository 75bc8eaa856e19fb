"""The front's rules on top of llhttp, checked directly (no sockets): each refusal says why."""

from __future__ import annotations

import httptools
import pytest

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.proxy.http.inbound import PIECE_BYTES, Refused, Request, Rules, check_head, refusal


def _req(*headers: tuple[bytes, bytes], method: bytes = b"POST", target: bytes = b"/") -> Request:
    req = Request()
    req.method, req.target = method, target
    for name, value in headers:
        req.headers.append((name, value))
    return req


def _rules(**kw: object) -> Rules:
    return Rules(ProxyConfig(max_body_bytes=2048, **kw))  # type: ignore[arg-type]


HOST = (b"Host", b"localhost:8000")
KEY = (b"Authorization", b"Bearer k")
ADMIN = b"/proxy/upstreams"


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
        (_req(HOST), "1.1", 401, "Authorization: Bearer <key>"),
        (_req(HOST, KEY, (b"Expect", b"x")), "1.1", 417, "Expect"),
        # what a web page can make a browser send without a CORS preflight
        (_req(HOST, KEY, (b"Origin", b"https://evil.example")), "1.1", 403, "Origin"),
        (
            _req(HOST, KEY, (b"Content-Type", b"text/plain"), (b"Content-Length", b"2")),
            "1.1",
            415,
            "application/json",
        ),
        (
            _req(
                HOST,
                KEY,
                (b"Content-Type", b"application/x-www-form-urlencoded"),
                (b"Transfer-Encoding", b"chunked"),
            ),
            "1.1",
            415,
            "application/json",
        ),
        (_req((b"Host", b"evil.example:8000"), KEY), "1.1", 403, "DNS rebinding"),
        (_req((b"Host", b"127.0.0.1.evil.example"), KEY), "1.1", 403, "DNS rebinding"),
        # the admin routes take the admin key only, and are off without one
        (_req(HOST, KEY, target=ADMIN), "1.1", 401, "admin key"),
        (_req(HOST, KEY, method=b"DELETE", target=ADMIN), "1.1", 401, "admin key"),
        (_req(HOST, KEY, method=b"GET", target=ADMIN), "1.1", 200, ""),  # reading: client key
        (_req(HOST, method=b"GET", target=ADMIN), "1.1", 401, "Bearer <key>"),
        (_req(HOST, (b"Authorization", b"Bearer a"), target=ADMIN + b"?x"), "1.1", 200, ""),
        (_req(HOST, (b"Authorization", b"Bearer a")), "1.1", 401, "Bearer <key>"),
    ],
)
def test_refused_heads(req: Request, version: str, status: int, message: str) -> None:
    rules = _rules(api_key="k", admin_api_key="a")
    if status == 200:
        return check_head(req, version, rules)
    with pytest.raises(Refused, match=message) as info:
        check_head(req, version, rules)
    assert info.value.status == status


def test_admin_routes_are_off_without_an_admin_key() -> None:
    with pytest.raises(Refused, match="ASYNCGRPO_PROXY_ADMIN_API_KEY") as info:
        check_head(_req(HOST, KEY, target=ADMIN), "1.1", _rules(api_key="k"))
    assert info.value.status == 403


def test_accepted_heads() -> None:
    rules = _rules()
    chunked = _req(HOST, (b"Transfer-Encoding", b"Chunked"), (b"Expect", b"100-Continue"))
    check_head(chunked, "1.1", rules)
    check_head(_req(), "1.0", rules)  # HTTP/1.0 needs no Host
    check_head(_req(HOST, KEY), "1.1", _rules(api_key="k"))
    for host in (b"127.0.0.1", b"127.0.0.1:80", b"[::1]:8000", b"LOCALHOST"):
        check_head(_req((b"Host", host)), "1.1", rules)
    json_types = (b"application/json", b"Application/JSON; charset=utf-8", b"application/x+json")
    for ct in json_types:
        check_head(_req(HOST, (b"Content-Type", ct), (b"Content-Length", b"2")), "1.1", rules)
    # no body: the content type says nothing; a public bind checks no Host (its key does)
    check_head(_req(HOST, (b"Content-Type", b"text/plain")), "1.1", rules)
    public = _rules(host="0.0.0.0", api_key="k")
    check_head(_req((b"Host", b"proxy.example"), KEY), "1.1", public)


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed header"),
        (b"GET / HTTP/1.1\r\nX: a\x00\r\n\r\n", 400, "malformed header"),
        (b"GET / HTTP/1.7\r\n\r\n", 505, "HTTP version"),
        (
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
            400,
            "both Content-Length and Transfer-Encoding",
        ),
    ],
)
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


def test_the_book_of_runs_takes_the_admin_key_for_writes_when_there_is_one() -> None:
    runs = b"/proxy/runs"
    keyed = _rules(api_key="k", admin_api_key="a")
    for method in (b"POST", b"DELETE"):
        with pytest.raises(Refused, match="admin key") as info:
            check_head(_req(HOST, KEY, method=method, target=runs), "1.1", keyed)
        assert info.value.status == 401
        check_head(
            _req(HOST, (b"Authorization", b"Bearer a"), method=method, target=runs), "1.1", keyed
        )
        # no admin key: the client key (or, on loopback without one, nothing), as before
        check_head(_req(HOST, KEY, method=method, target=runs), "1.1", _rules(api_key="k"))
        check_head(_req(HOST, method=method, target=runs), "1.1", _rules())
    check_head(_req(HOST, KEY, method=b"GET", target=runs), "1.1", keyed)  # reading


def test_a_body_in_small_pieces_is_held_in_few_objects() -> None:
    """Pieces under PIECE_BYTES are joined as they arrive; a large one is kept as it came (not
    copied), and a body in one piece stays that piece."""
    req = Request()
    pieces = [b"a"] * 200_000 + [b"B" * PIECE_BYTES] + [b"c"] * 10
    for piece in pieces:
        req.add(piece)
    assert b"".join(req.body) == b"".join(pieces)
    assert len(req.body) <= 6
    assert any(p is pieces[200_000] for p in req.body)
    one, whole = Request(), b"x" * 100
    one.add(whole)
    assert one.body == [whole] and one.body[0] is whole

"""The front refuses malformed and ambiguous requests, forwarding nothing of them.

A corpus of hostile requests (bad header values and names, conflicting framing, request
smuggling forms CL.TE / TE.CL / TE.TE, unsupported codings, bad chunks, Host rules, versions,
oversized and trickling heads, pipelining after an error) and a property test of random
mutations of a valid request are sent on raw sockets to the proxy, in front of a raw recording
upstream that parses (with llhttp) and counts every request it receives.

The proxy and the upstream run in a thread with their own event loop, so the test talks to them
with plain blocking sockets, as a hostile client would.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncgrpo.proxy import ProxyConfig, serve_proxy

MAX_BODY = 4096


@dataclass
class Recorder:
    """What the raw upstream received: every byte, and each request llhttp completed."""

    raw: bytearray = field(default_factory=bytearray)
    requests: list[tuple[bytes, bytes, bytes]] = field(default_factory=list)  # method, url, body


class _UpstreamConn(asyncio.Protocol):
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.rec.raw += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # the proxy forwarded something llhttp refuses
            self.rec.requests.append((b"INVALID", b"", bytes(data)))
            self.transport.close()  # type: ignore[attr-defined]

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        method, body = self.parser.get_method(), b"".join(self.body)
        self.rec.requests.append((method, self.url, body))
        answer = json.dumps({"echo": body.decode("latin-1")}).encode()
        self.transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(answer), answer)
        )


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[int, Recorder]]:
    """(proxy port, recorder); the proxy knows its block size and never health-checks."""
    rec = Recorder()
    ready: list[int] = []
    stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _UpstreamConn(rec), "127.0.0.1", 0)
        up_port = server.sockets[0].getsockname()[1]
        config = ProxyConfig(
            upstreams=(f"http://127.0.0.1:{up_port}",),
            port=0,
            block_size=16,
            health_interval_s=3600,
            max_body_bytes=MAX_BODY,
            client_idle_timeout_s=1.0,
            head_timeout_s=1.0,
        )
        async with serve_proxy(config) as base:
            stop.append((loop, asyncio.Event()))
            ready.append(int(base.rsplit(":", 1)[1]))
            await stop[0][1].wait()
        server.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    for _ in range(200):
        if ready:
            break
        time.sleep(0.05)
    assert ready, "the proxy did not start"
    yield ready[0], rec
    loop, event = stop[0]
    loop.call_soon_threadsafe(event.set)
    thread.join(10)


class _Answers:
    """Complete responses parsed from the proxy's bytes (llhttp, in the test too)."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []

    def on_body(self, data: bytes) -> None:
        self._body.append(data)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status >= 200:  # 100 Continue is interim
            self.statuses.append(status)
            self.bodies.append(b"".join(self._body))
        self._body = []


def _exchange(
    port: int, pieces: list[bytes], *, pause_s: float = 0.0, half_close: bool = False
) -> tuple[_Answers, bool]:
    """Send ``pieces`` (pausing between them), read until the proxy closes (or 10 s pass);
    returns (answers, closed by the proxy)."""
    answers = _Answers()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for piece in pieces:
                s.sendall(piece)
                if pause_s:
                    time.sleep(pause_s)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the proxy may close while we still send (a refused head)
        try:
            while data := s.recv(65536):
                answers.parser.feed_data(data)
        except TimeoutError:
            return answers, False
        except OSError:
            pass  # a reset after the answer: closed all the same
    return answers, True


def _post(body: bytes, extra: bytes = b"", *, head: bytes | None = None) -> bytes:
    head = head or b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _body(tag: str) -> bytes:
    return json.dumps({"model": "m", "prompt": f"corpus-{tag}"}).encode()


GOOD = _post(_body("good"))
GOOD_CLOSE = _post(_body("good"), b"Connection: close\r\n")
P = b"POST /v1/completions HTTP/1.1\r\n"
H = b"Host: localhost\r\n"
B = _body("bad")
CHUNKED = P + H + b"Transfer-Encoding: chunked\r\n\r\n"
BIG_HEADER = b"X-Big: " + b"a" * 70_000 + b"\r\n"

# (name, bytes pieces sent, expected statuses in order; the connection must then be closed)
# fmt: off
CORPUS: list[tuple[str, list[bytes], list[int]]] = [
    # header values
    ("CR in value", [_post(B, b"X-A: a\rb\r\n")], [400]),
    ("bare LF in value", [_post(B, b"X-A: a\nX-B: b\r\n")], [400]),
    ("NUL in value", [_post(B, b"X-A: a\x00b\r\n")], [400]),
    ("control char in value", [_post(B, b"X-A: a\x01b\r\n")], [400]),
    ("DEL in value", [_post(B, b"X-A: a\x7fb\r\n")], [400]),
    ("NUL in Authorization", [_post(B, b"Authorization: Bearer \x00\r\n")], [400]),
    # header names
    ("space before colon", [_post(B, b"X-A : b\r\n")], [400]),
    ("space before colon on CL", [P + H + b"Content-Length : 5\r\n\r\nhello"], [400]),
    ("separator in name", [_post(B, b"X(a): b\r\n")], [400]),
    ("empty name", [_post(B, b": b\r\n")], [400]),
    ("obs-fold", [_post(B, b"X-A: a\r\n folded\r\n")], [400]),
    ("line without colon", [_post(B, b"NoColonHere\r\n")], [400]),
    ("whitespace before first header", [P + b" Host: localhost\r\nContent-Length: 2\r\n\r\n{}"], [400]),
    # Content-Length
    ("duplicate Content-Length, same", [_post(B, b"Content-Length: %d\r\n" % len(B))], [400]),
    ("duplicate Content-Length, differing", [_post(B, b"Content-Length: 1\r\n")], [400]),
    ("Content-Length list", [P + H + b"Content-Length: 2, 2\r\n\r\n{}"], [400]),
    ("Content-Length plus sign", [P + H + b"Content-Length: +2\r\n\r\n{}"], [400]),
    ("Content-Length negative", [P + H + b"Content-Length: -1\r\n\r\n{}"], [400]),
    ("Content-Length hex", [P + H + b"Content-Length: 0x2\r\n\r\n{}"], [400]),
    ("Content-Length overflow", [P + H + b"Content-Length: 99999999999999999999999\r\n\r\n"], [400]),
    ("Content-Length empty", [P + H + b"Content-Length: \r\n\r\n{}"], [400]),
    # request smuggling
    ("CL.TE", [P + H + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG" + GOOD], [400]),
    ("TE.CL", [P + H + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n"], [400]),
    ("TE.TE second coding", [P + H + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n"], [400]),
    ("TE.TE space in name", [P + H + b"Transfer-Encoding : chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n"], [400]),
    ("TE.TE xchunked", [P + H + b"Transfer-Encoding: xchunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n"], [400]),
    ("TE.TE chunked twice", [P + H + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n"], [400]),
    # transfer codings
    ("TE gzip", [P + H + b"Transfer-Encoding: gzip\r\n\r\n"], [501]),
    ("TE gzip, chunked", [P + H + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"], [501]),
    ("TE identity", [P + H + b"Transfer-Encoding: identity\r\n\r\n"], [501]),
    ("TE chunked, gzip", [P + H + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n"], [400]),
    ("TE empty", [P + H + b"Transfer-Encoding: \r\n\r\n"], [400]),
    ("TE in HTTP/1.0", [b"POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"], [400]),
    # chunk sizes and chunk framing
    ("chunk size 0x", [CHUNKED + b"0x2\r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk size trailing space", [CHUNKED + b"2 \r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk size negative", [CHUNKED + b"-2\r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk size overflow", [CHUNKED + b"fffffffffffffffffff\r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk size missing", [CHUNKED + b"\r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk data without CRLF", [CHUNKED + b"2\r\n{}XX0\r\n\r\n"], [400]),
    ("chunk size bare LF", [CHUNKED + b"2\n{}\r\n0\r\n\r\n"], [400]),
    ("chunk extension control char", [CHUNKED + b"2;a\x01\r\n{}\r\n0\r\n\r\n"], [400]),
    ("chunked body over the limit", [CHUNKED + b"%x\r\n%s\r\n0\r\n\r\n" % (MAX_BODY + 1, b"x" * (MAX_BODY + 1))], [413]),
    # Host
    ("no Host on HTTP/1.1", [P + b"Content-Length: %d\r\n\r\n%s" % (len(B), B)], [400]),
    ("two Host headers", [_post(B, b"Host: other\r\n")], [400]),
    ("two equal Host headers", [_post(B, b"Host: localhost\r\n")], [400]),
    # versions and request lines
    ("HTTP/2.0", [_post(B, head=b"POST /v1/completions HTTP/2.0\r\nHost: localhost\r\n")], [505]),
    ("HTTP/1.2", [_post(B, head=b"POST /v1/completions HTTP/1.2\r\nHost: localhost\r\n")], [505]),
    ("HTTP/0.9", [_post(B, head=b"POST /v1/completions HTTP/0.9\r\nHost: localhost\r\n")], [505]),
    ("HTTP/3.0", [_post(B, head=b"POST /v1/completions HTTP/3.0\r\nHost: localhost\r\n")], [505]),
    ("lower-case version", [_post(B, head=b"POST /v1/completions http/1.1\r\nHost: localhost\r\n")], [400]),
    ("lower-case method", [_post(B, head=b"post /v1/completions HTTP/1.1\r\nHost: localhost\r\n")], [400]),
    ("space in target", [_post(B, head=b"POST /v1/completions x HTTP/1.1\r\nHost: localhost\r\n")], [400]),
    ("NUL in target", [_post(B, head=b"POST /v1/\x00completions HTTP/1.1\r\nHost: localhost\r\n")], [400]),
    ("bare LF line ends", [b"POST /v1/completions HTTP/1.1\nHost: proxy\nContent-Length: 2\n\n{}"], [400]),
    ("CONNECT", [b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n"], [405]),
    # sizes and expectations
    ("head over 64 KiB in one header", [_post(B, BIG_HEADER)], [431]),
    ("head over 64 KiB in many headers", [_post(B, b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)))], [431]),
    ("oversized head trickled", [P + H, *[b"X-Big: " + b"a" * 8000 + b"\r\n"] * 10], [431]),
    ("body over the limit", [_post(b"x" * (MAX_BODY + 1))], [413]),
    ("unknown expectation", [_post(B, b"Expect: 200-ok\r\n")], [417]),
    # trailers after a chunked body: the head's limits hold for them too
    ("trailers over 64 KiB", [CHUNKED + b"2\r\n{}\r\n0\r\n" + b"".join(b"X-T%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n"], [431]),
    ("trailers over 64 KiB trickled", [CHUNKED + b"2\r\n{}\r\n0\r\n", *[b"X-T: " + b"a" * 8000 + b"\r\n"] * 10, b"\r\n"], [431]),
    ("one trailer over 64 KiB trickled", [CHUNKED + b"2\r\n{}\r\n0\r\nX-T: ", *[b"a" * 8000] * 10, b"\r\n\r\n"], [431]),
    ("trailer fields over 256", [CHUNKED + b"2\r\n{}\r\n0\r\n" + b"X-T: 1\r\n" * 300 + b"\r\n"], [431]),
    ("header fields over 256", [_post(B, b"X-A: 1\r\n" * 300)], [431]),
    # request targets: a path only
    ("absolute-form target", [_post(B, head=b"POST http://localhost/v1/completions HTTP/1.1\r\nHost: localhost\r\n")], [400]),
    ("absolute-form GET", [b"GET http://127.0.0.1:1/health HTTP/1.1\r\nHost: localhost\r\n\r\n"], [400]),
    ("asterisk target", [b"OPTIONS * HTTP/1.1\r\nHost: localhost\r\n\r\n"], [400]),
    # pipelining after an error
    ("bad then good, pipelined", [_post(B, b"X-A: a\x00\r\n") + GOOD], [400]),
    ("good, bad, good, pipelined", [GOOD + _post(B, b"Host: other\r\n") + GOOD], [200, 400]),
    ("good then smuggled, pipelined", [GOOD + P + H + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"], [200, 400]),
]
# fmt: on


def _check(port: int, rec: Recorder, name: str, pieces: list[bytes], want: list[int]) -> str:
    """'' if the case went as expected, else what went wrong."""
    before = len(rec.requests)
    answers, closed = _exchange(port, pieces, pause_s=0.02 if len(pieces) > 1 else 0.0)
    time.sleep(0.05)
    forwarded = rec.requests[before:]
    wrong = []
    if answers.statuses != want:
        wrong.append(f"statuses {answers.statuses} != {want}")
    good = sum(1 for s in want if s == 200)
    if len(forwarded) != good or any(b"corpus-good" not in body for _, _, body in forwarded):
        wrong.append(f"forwarded {[b[:60] for _, _, b in forwarded]}")
    if not closed:
        wrong.append("connection left open")
    for status, body in zip(answers.statuses, answers.bodies, strict=False):
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = ""
        if status >= 400 and not message:
            wrong.append(f"an error without an OpenAI-style message: {body[:60]!r}")
    return f"{name}: {'; '.join(wrong)}" if wrong else ""


def test_corpus_refused_nothing_forwarded_proxy_keeps_serving(proxy) -> None:
    port, rec = proxy
    assert len(CORPUS) >= 40
    failures = []
    for name, pieces, want in CORPUS:
        if failure := _check(port, rec, name, pieces, want):
            failures.append(failure)
        answers, _ = _exchange(port, [GOOD_CLOSE])  # the proxy still serves
        if answers.statuses != [200]:
            failures.append(f"{name}: the proxy stopped serving ({answers.statuses})")
    assert not failures, f"{len(failures)} wrong in {len(CORPUS)} cases:\n" + "\n".join(failures)
    assert b"SMUGGLED" not in rec.raw and b"corpus-bad" not in rec.raw


def test_trickling_head_is_cut_off_without_forwarding(proxy) -> None:
    port, rec = proxy
    before = len(rec.raw)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(P + H)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 4:  # a byte every 0.2 s, the head never finished
                s.sendall(b"x")
                time.sleep(0.2)
            closed = False
        except OSError:
            closed = True
        if not closed:
            s.settimeout(1)
            closed = s.recv(1024) == b""
    assert closed, "the trickling client was not disconnected"
    assert len(rec.raw) == before


def test_half_closed_client_gets_its_answers(proxy) -> None:
    port, rec = proxy
    before = len(rec.requests)
    answers, closed = _exchange(port, [GOOD + GOOD], half_close=True)
    assert answers.statuses == [200, 200] and closed
    assert len(rec.requests) == before + 2


# -- property: random mutations of a valid request ------------------------------------------------

_VALID = (
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"X-Trace: abc\r\nContent-Length: %d\r\n\r\n%s"
)
_ATOMS = [b"\r", b"\n", b"\r\n", b"\x00", b" ", b"\t", b":", b",", b";", b"0", b"9", b"f",
          b"chunked", b"Transfer-Encoding: chunked\r\n", b"Content-Length: 3\r\n",
          b"Host: x\r\n", b"HTTP/1.0", b"\x7f", b"\xff", b"\r\n\r\n",
          b"0\r\nX-Trailer: t\r\n\r\n", b"http://localhost"]  # fmt: skip


def _reference(data: bytes) -> list[bytes]:
    """Bodies of the requests llhttp completes in ``data`` before any error."""
    bodies: list[bytes] = []
    cur: list[bytes] = []

    class Sink:
        def on_message_begin(self) -> None:
            cur.clear()

        def on_body(self, b: bytes) -> None:
            cur.append(b)

        def on_message_complete(self) -> None:
            bodies.append(b"".join(cur))

    parser = httptools.HttpRequestParser(Sink())
    try:
        parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        pass
    return bodies


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    body = json.dumps({"model": "m", "prompt": draw(st.text(max_size=20))}).encode()
    data = bytearray(_VALID % (len(body), body))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        atom = draw(st.sampled_from(_ATOMS))
        if op == "insert":
            data[pos:pos] = atom
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "replace":
            data[pos : pos + len(atom)] = atom
        else:
            line_start = data.rfind(b"\r\n", 0, pos) + 2
            line_end = data.find(b"\r\n", pos)
            if line_end > line_start:
                data[line_end + 2 : line_end + 2] = data[line_start : line_end + 2]
    return bytes(data)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_mutated())
def test_mutations_never_forward_what_the_parser_refused(proxy, data: bytes) -> None:
    port, rec = proxy
    before = len(rec.requests)
    answers, closed = _exchange(port, [data], half_close=True)
    assert closed
    forwarded = [body for _, _, body in rec.requests[before:]]
    accepted = _reference(data)
    # Whatever reached the upstream is a request llhttp fully accepted, byte for byte.
    assert len(forwarded) <= len(accepted) and all(b in accepted for b in forwarded)
    assert all(
        s in (200, 400, 401, 403, 404, 405, 413, 415, 417, 431, 501, 505) for s in answers.statuses
    )
    again, _ = _exchange(port, [GOOD], half_close=True)  # and the proxy still serves
    assert again.statuses == [200]


@pytest.mark.parametrize("stream", [False, True])
def test_deeply_nested_json_is_a_400_and_not_forwarded(proxy, stream: bool) -> None:
    port, rec = proxy
    before = len(rec.requests)
    deep = b'{"model": "m", "stream": %s, "prompt": %s"x"%s}' % (
        b"true" if stream else b"false",
        b"[" * 1500,
        b"]" * 1500,
    )
    head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
    answers, closed = _exchange(port, [_post(deep, head=head)])
    assert answers.statuses == [400] and closed
    assert "deeper than" in json.loads(answers.bodies[0])["error"]["message"]
    assert len(rec.requests) == before


def test_head_answer_has_no_body_and_the_connection_goes_on(proxy) -> None:
    port, _ = proxy
    head = b"HEAD /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"
    get = b"GET /proxy/stats HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + get)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"Content-Length" in first
    assert rest.startswith(b"HTTP/1.1 200")  # no body between the two answers
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["rejected"] is not None


def test_a_small_trailer_is_dropped_and_the_body_forwarded(proxy) -> None:
    port, rec = proxy
    before = len(rec.requests)
    body = _body("good")
    chunked = CHUNKED + b"%x\r\n%s\r\n0\r\nX-Checksum: 1\r\n\r\n" % (len(body), body)
    answers, closed = _exchange(port, [chunked], half_close=True)
    assert answers.statuses == [200] and closed
    assert [b for _, _, b in rec.requests[before:]] == [body]
    assert b"X-Checksum" not in rec.raw

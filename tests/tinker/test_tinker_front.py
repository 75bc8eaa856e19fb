"""The service's HTTP front holds a client to the proxy's limits: a connection cap, head and idle
timeouts, per-route body limits, Host and Origin checks, one-line refusals (no vLLM: the
service's HTTP layer on the tiny model, over real sockets)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest


def _addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _request(url: str, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send ``raw`` on a new connection, reading the answer meanwhile (a server may answer and
    close before the body is all sent); everything answered until it closes or ``timeout``."""
    import threading

    got: list[bytes] = []

    def read(s: socket.socket) -> None:
        try:
            while chunk := s.recv(65536):
                got.append(chunk)
        except OSError:
            pass

    with socket.create_connection(_addr(url), timeout=timeout) as s:
        reader = threading.Thread(target=read, args=(s,))
        reader.start()
        try:
            s.sendall(raw)  # no half-close: aiohttp closes on the end of input
        except OSError:  # the server answered and closed first
            pass
        reader.join(timeout)
    return b"".join(got)


def _closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (nothing to read but the end)."""
    s.settimeout(0.01)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _healthz_s(url: str) -> float:
    import httpx

    started = time.monotonic()
    r = httpx.get(f"{url}/api/v1/healthz", timeout=10)
    assert r.status_code == 200, r.text
    return time.monotonic() - started


def test_idle_connections_beyond_the_cap_are_closed_and_healthz_answers(
    tiny_model: Path, start_service
) -> None:
    with start_service(tiny_model, max_connections=64) as served:
        idle = [socket.create_connection(_addr(served.url)) for _ in range(200)]
        try:
            assert _healthz_s(served.url) < 0.25
            time.sleep(0.2)
            still_open = [s for s in idle if not _closed(s)]
            assert len(still_open) <= 64, f"{len(still_open)} idle connections held, cap 64"
        finally:
            for s in idle:
                s.close()


def test_a_connection_past_the_cap_is_answered_503_when_every_open_one_is_busy(
    tiny_model: Path, start_service
) -> None:
    with start_service(tiny_model, max_connections=64) as served:
        busy = []  # each in a request, its body still coming: never closed to make room
        for _ in range(64):
            s = socket.create_connection(_addr(served.url))
            s.sendall(
                b"POST /api/v1/create_session HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            busy.append(s)
        try:
            time.sleep(0.5)
            answer = _request(
                served.url, b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
            )
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer, answer
            assert not any(_closed(s) for s in busy)
        finally:
            for s in busy:
                s.close()
        assert _healthz_s(served.url) < 1.0


def test_a_head_sent_a_byte_at_a_time_is_cut_off(tiny_model: Path, start_service) -> None:
    with start_service(tiny_model, head_timeout_s=1.0) as served:
        with socket.create_connection(_addr(served.url)) as s:
            s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\n")
            started = time.monotonic()
            closed_after = None
            while time.monotonic() - started < 6:
                try:
                    s.sendall(b"X")
                except OSError:
                    closed_after = time.monotonic() - started
                    break
                if _closed(s):
                    closed_after = time.monotonic() - started
                    break
                time.sleep(0.2)
            assert closed_after is not None and closed_after < 3, "slow head held"


def test_an_idle_connection_is_closed_after_the_idle_timeout(
    tiny_model: Path, start_service
) -> None:
    with start_service(tiny_model, client_idle_timeout_s=1.0) as served:
        with socket.create_connection(_addr(served.url)) as s:
            s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            s.settimeout(5)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(2.5)
            assert _closed(s)


def _vm(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` in bytes (the service runs in it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS


def _post(url: str, path: str, body: bytes, content_type: str, *, chunked: bool = False) -> bytes:
    head = b"POST /api/v1/%s HTTP/1.1\r\nHost: localhost\r\nContent-Type: %s\r\n" % (
        path.encode(),
        content_type.encode(),
    )
    if chunked:
        framed = b"".join(
            b"%x\r\n%s\r\n" % (min(65536, len(body) - i), body[i : i + 65536])
            for i in range(0, len(body), 65536)
        )
        raw = (
            head
            + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + framed
            + b"0\r\n\r\n"
        )
    else:
        raw = head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    return _request(url, raw, timeout=60)


def _while_healthz(url: str, send) -> tuple[bytes, list[float]]:
    """``send()`` in a thread while ``healthz`` is timed in a loop; its answer and the times."""
    from concurrent.futures import ThreadPoolExecutor

    took = []
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send)
        while not sent.done():
            took.append(_healthz_s(url))
            time.sleep(0.02)
        return sent.result(), took


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_15_mb_control_body_is_refused_at_its_route_s_limit(served, chunked: bool) -> None:
    """A create_session of 15 MB of ``{}`` tags took 16.6 s and peaked at 6.2 GB; now 413 at
    64 KiB, without reading the rest, and the event loop keeps answering."""
    body = b'{"tags": [' + b"{}," * 5_000_000 + b'{}], "user_metadata": {}, "sdk_version": "x"}'
    _reset_peak()
    before = _vm("VmRSS")
    answer, took = _while_healthz(
        served.url,
        lambda: _post(served.url, "create_session", body, "application/json", chunked=chunked),
    )
    grown = _vm("VmHWM") - before
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"over 65536 bytes" in answer
    assert grown < 100e6, f"grew {grown / 1e6:.0f} MB"
    assert max(took, default=0) < 0.25, [f"{t * 1000:.0f} ms" for t in took]


def test_a_deep_or_broken_json_body_is_a_one_line_400(served) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    answer = _post(served.url, "create_session", deep, "application/json")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]  # over the control limit first
    deep = b'{"tags": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    answer = _post(served.url, "create_session", deep, "application/json")
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"deeper than 128" in answer and b"Traceback" not in answer
    many = b'{"tags": [' + b"1," * 20_000 + b'1], "user_metadata": {}, "sdk_version": "x"}'
    answer = _post(served.url, "create_session", many, "application/json")
    assert answer.startswith(b"HTTP/1.1 400") and b"fields do not fit its schema" in answer


def _fwdbwd_body(model_id: str, datums: int, tokens: int) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    ids = (b"\x01\x00\x00\x00") * tokens
    for _ in range(datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = ids
        for name, dtype, size in (
            ("target_tokens", pb.DTYPE_INT64, 8),
            ("weights", pb.DTYPE_FLOAT32, 4),
        ):
            t = d.loss_fn_inputs[name]
            t.dtype, t.dense = dtype, b"\x00" * (size * tokens)
    return msg.SerializeToString()


def test_forward_backward_refuses_empty_and_too_many_datums_before_the_work(
    service_client, served
) -> None:
    """Datums of no tokens passed every check (about 31,700 per MB) and an 8 MB request held
    the worker 60-114 s; the service grew 927 -> 1,474 MB over three of them."""
    training = service_client.create_lora_training_client(base_model=served.model, rank=1).result()
    empty = _fwdbwd_body(training.model_id, 280_000, 0)
    assert len(empty) > 2_000_000
    _reset_peak()
    before = _vm("VmRSS")
    for _ in range(3):
        started = time.monotonic()
        answer = _post(served.url, "forward_backward", empty, "application/x-protobuf")
        assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
        assert b"max_datums" in answer
        assert time.monotonic() - started < 5
    grown = _vm("VmHWM") - before
    assert grown < 100e6, f"grew {grown / 1e6:.0f} MB"
    answer = _post(
        served.url,
        "forward_backward",
        _fwdbwd_body(training.model_id, 3, 0),
        "application/x-protobuf",
    )
    assert answer.startswith(b"HTTP/1.1 400") and b"datum 0 has no tokens" in answer, answer[:300]
    unknown = _post(
        served.url,
        "forward_backward",
        _fwdbwd_body("s-nobody_m0", 1000, 2000),
        "application/x-protobuf",
    )
    assert unknown.startswith(b"HTTP/1.1 404"), unknown[:300]


def test_a_forward_backward_body_over_its_limit_is_413(tiny_model: Path, start_service) -> None:
    with start_service(tiny_model, max_body_bytes=1 << 20) as served:
        body = _fwdbwd_body("s-x_m0", 10, 30_000)
        answer = _post(served.url, "forward_backward", body, "application/x-protobuf")
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        answer = _post(served.url, "forward_backward", body, "application/x-protobuf", chunked=True)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]


@pytest.mark.parametrize("host", [b"evil.example", b"evil.example:8000", b"10.0.0.1"])
def test_a_loopback_service_answers_only_a_loopback_host(served, host: bytes) -> None:
    answer = _request(
        served.url,
        b"GET /api/v1/training_runs HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host,
    )
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"DNS rebinding" in answer
    ok = _request(
        served.url,
        b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost:1\r\nConnection: close\r\n\r\n",
    )
    assert ok.startswith(b"HTTP/1.1 200"), ok[:200]


def test_an_api_key_that_is_not_utf8_is_a_401(tiny_model: Path, start_service) -> None:
    with start_service(tiny_model, api_key="tml-the-key") as served:
        answer = _request(
            served.url,
            b"GET /api/v1/healthz HTTP/1.1\r\nHost: localhost\r\nX-API-Key: \xff\xfe\r\n"
            b"Connection: close\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]


def test_a_broken_run_entry_neither_stops_the_listing_nor_shows_a_path(
    tiny_model: Path, start_service, tmp_path: Path
) -> None:
    """One malformed ``tinker-runs/*.json`` in storage made every listing 500; a failure of
    the service named store paths in what its client saw."""
    import httpx
    import tinker

    with start_service(tiny_model, work_dir=str(tmp_path)) as served:
        client = tinker.ServiceClient(base_url=served.url)
        training = client.create_lora_training_client(base_model=served.model, rank=1).result()
        runs = tmp_path / "store" / "tinker-runs"
        (runs / "broken.json").write_text("{not json")
        (runs / "shaped.json").write_text('{"run_id": 3, "checkpoints": "x"}')
        listed = httpx.get(f"{served.url}/api/v1/training_runs")
        assert listed.status_code == 200, listed.text
        ids = [r["training_run_id"] for r in listed.json()["training_runs"]]
        assert ids == [training.model_id.replace(":", "-")] or len(ids) == 1, ids
        one = httpx.get(f"{served.url}/api/v1/training_runs/shaped")
        assert one.status_code == 500 and "\n" not in one.text.strip(), one.text
        assert str(tmp_path) not in one.text and "tinker-runs" not in one.text, one.text
        (tmp_path / "store" / "tinker-states").write_text("a file where a directory goes")
        with pytest.raises(tinker.RequestFailedError) as failed:
            training.save_state("x").result()
        assert "the server failed (" in str(failed.value), failed.value
        assert str(tmp_path) not in str(failed.value), failed.value
        client.close("success").result()

"""The service's HTTP front holds a client to the proxy's limits: a connection cap, head and idle
timeouts, per-route body limits, Host and Origin checks, one-line refusals (no vLLM: the
service's HTTP layer on the tiny model, over real sockets)."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit


def _addr(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _request(url: str, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send ``raw`` on a new connection; everything answered until the server closes or
    ``timeout``."""
    with socket.create_connection(_addr(url), timeout=timeout) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


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

"""The one table from an upstream outcome to how it counts against the replica."""

from __future__ import annotations

import pytest

from asyncgrpo.proxy.http.h1 import ConnectFailed, Disconnected
from asyncgrpo.proxy.upstream import failure_kind


@pytest.mark.parametrize(
    ("outcome", "want"),
    [
        (200, None),
        (404, None),  # the client's answer, not the replica's failure
        (500, ("http_500", True)),
        (503, ("http_503", True)),
        (ConnectFailed("refused"), ("connect", True)),
        (TimeoutError("slow"), ("deadline", True)),
        (Disconnected("cut short"), ("disconnect", False)),  # a keep-alive race looks the same
        (OSError("reset"), ("disconnect", False)),
    ],
)
def test_failure_kind(outcome: object, want: tuple[str, bool] | None) -> None:
    assert failure_kind(outcome) == want  # type: ignore[arg-type]


class _Due:
    """A request in flight whose deadline has passed; ``fail`` makes ending it raise."""

    def __init__(self, fail: bool) -> None:
        self.due, self.fail, self.ended = 0.0, fail, False

    def on_deadline(self) -> None:
        self.ended = True
        if self.fail:
            raise RuntimeError("a bug while ending a request")

    def expire(self) -> bool:
        return False


@pytest.mark.anyio
async def test_a_request_failing_at_its_deadline_stops_no_other_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The deadline check runs every tick for every request: one that raises is logged and
    dropped, the others still end (an escaping error would end the periodic task, and with it
    every later deadline: requests would hang until their clients gave up)."""
    import asyncio

    from asyncgrpo.config.proxy import ProxyConfig
    from asyncgrpo.proxy.state import Proxy

    proxy = Proxy(ProxyConfig(upstreams=("http://127.0.0.1:9",)), asyncio.get_running_loop())
    bad, good = _Due(fail=True), _Due(fail=False)
    proxy.inflight.update((bad, good))
    proxy.tick()
    assert bad.ended and good.ended
    assert bad not in proxy.inflight
    assert "a bug while ending a request" in caplog.text
    proxy.pool.close()

"""The one table from an upstream outcome to how it counts against the replica."""

from __future__ import annotations

import pytest

from asyncgrpo.proxy.h1 import ConnectFailed, Disconnected
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

"""Fixtures shared by the proxy tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "uvloop"])
def both_loops(request: pytest.FixtureRequest) -> object:
    """An anyio backend per event loop: the CLI runs on uvloop, whose transports differ from
    asyncio's. A module opts in with an ``anyio_backend`` fixture returning this one."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"

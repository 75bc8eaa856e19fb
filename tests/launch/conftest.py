"""Fixtures of the launch tests: a local Hub that speaks the Jobs REST API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_jobs_hub import FakeHub


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub()
    server.start()
    try:
        yield server
    finally:
        server.stop()

"""The one backoff schedule (pure) and the two loops on it, on a fake clock."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from asyncgrpo.retry import Backoff, RetryNow, poll_until, retry

T = TypeVar("T")

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("backoff", "retry_number", "draw", "wait"),
    [
        (Backoff(0.5), 1, 0.0, 0.5),
        (Backoff(0.5), 4, 0.0, 4.0),
        (Backoff(0.5, max_s=3.0), 4, 0.0, 3.0),
        (Backoff(30.0, max_s=600.0), 6, 0.0, 600.0),
        (Backoff(2.0, factor=1.0), 7, 0.0, 2.0),
        (Backoff(1.0, factor=3.0), 3, 0.0, 9.0),
        (Backoff(4.0, jitter=0.5), 1, 0.5, 3.0),  # a quarter taken off
        (Backoff(4.0, jitter=1.0), 2, 0.999, 8.0 * 0.001),
        (Backoff(0.5, max_s=60.0), 5000, 0.0, 60.0),  # no overflow after days of failures
        (Backoff(0.0, max_s=60.0), 5000, 0.0, 0.0),
    ],
)
def test_the_schedule(backoff: Backoff, retry_number: int, draw: float, wait: float) -> None:
    assert backoff.delay(retry_number, draw) == pytest.approx(wait)


@pytest.mark.parametrize(
    "kwargs", [{"base_s": -1.0}, {"base_s": 1.0, "factor": 0.5}, {"base_s": 1.0, "jitter": 1.5}]
)
def test_a_bad_schedule_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)
    with pytest.raises(ValueError, match="count from 1"):
        Backoff(1.0).delay(0)


class FakeClock:
    """Time that passes only in ``sleep``."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def retry(self, attempt: Callable[[int], Awaitable[T]], **kwargs: Any) -> T:
        return await retry(attempt, clock=self, sleep=self.sleep, **kwargs)

    async def poll(self, probe: Callable[[], Awaitable[T | None]], **kwargs: Any) -> T | None:
        return await poll_until(probe, clock=self, sleep=self.sleep, **kwargs)


async def test_retry_waits_the_schedule_then_raises_the_last_error() -> None:
    clock = FakeClock()
    calls: list[int] = []
    heard: list[tuple[int, str, float]] = []

    async def attempt(n: int) -> str:
        calls.append(n)
        raise ConnectionError(f"down {n}")

    with pytest.raises(ConnectionError, match="down 4"):
        await clock.retry(
            attempt,
            attempts=4,
            backoff=Backoff(0.5),
            retry_on=OSError,
            on_retry=lambda n, e, w: heard.append((n, str(e), w)),
        )
    assert calls == [1, 2, 3, 4]
    assert clock.sleeps == [0.5, 1.0, 2.0]
    assert heard == [(1, "down 1", 0.5), (2, "down 2", 1.0), (3, "down 3", 2.0)]


async def test_retry_returns_what_succeeds_and_lets_other_errors_through() -> None:
    clock = FakeClock()

    async def flaky(n: int) -> int:
        if n < 3:
            raise TimeoutError
        return n * 10

    got = await clock.retry(flaky, attempts=None, backoff=Backoff(1.0), retry_on=TimeoutError)
    assert got == 30 and clock.sleeps == [1.0, 2.0]

    async def refused(n: int) -> int:
        raise PermissionError("no")  # not retried: an OSError, but not a TimeoutError

    with pytest.raises(PermissionError):
        await clock.retry(refused, attempts=5, backoff=Backoff(1.0), retry_on=TimeoutError)
    assert clock.sleeps == [1.0, 2.0]


async def test_retry_now_skips_the_wait_but_counts() -> None:
    clock = FakeClock()
    calls: list[int] = []

    async def attempt(n: int) -> None:
        calls.append(n)
        if n == 1:
            raise RetryNow("swapped")
        raise OSError("down")

    with pytest.raises(OSError, match="down"):
        await clock.retry(attempt, attempts=3, backoff=Backoff(1.0), retry_on=OSError)
    assert calls == [1, 2, 3]
    assert clock.sleeps == [2.0]  # none after the RetryNow; retry 2's wait after attempt 2


async def test_retry_gives_up_at_the_deadline() -> None:
    clock = FakeClock()

    async def attempt(n: int) -> None:
        clock.now += 0.25  # each attempt takes a quarter second
        raise OSError

    with pytest.raises(OSError):
        await clock.retry(
            attempt,
            attempts=None,
            backoff=Backoff(1.0),
            retry_on=OSError,
            timeout_s=5.0,
        )
    # 0.25 | 1 | 0.25 | 2 | 0.25 | cut to 1.25 (the deadline) | 0.25: past it, no more
    assert clock.sleeps == [1.0, 2.0, 1.25]
    assert clock.now == pytest.approx(105.25)


async def test_poll_until_returns_the_first_answer() -> None:
    clock = FakeClock()
    answers = iter([None, None, False, "ready"])

    async def probe() -> object:
        return next(answers)

    assert await clock.poll(probe, every=2.0) is False
    assert clock.sleeps == [2.0, 2.0]


async def test_poll_until_gives_up_at_the_deadline_with_a_last_probe_there() -> None:
    clock = FakeClock()
    probes: list[float] = []

    async def probe() -> None:
        probes.append(clock.now)

    assert await clock.poll(probe, every=3.0, timeout_s=10.0) is None
    assert probes == [100.0, 103.0, 106.0, 109.0, 110.0]
    assert math.fsum(clock.sleeps) == pytest.approx(10.0)


async def test_poll_until_with_a_backoff_and_a_failing_probe() -> None:
    clock = FakeClock()

    async def probe() -> None:
        if clock.now > 105:
            raise RuntimeError("the job ended")

    with pytest.raises(RuntimeError, match="ended"):
        await poll_until(probe, every=Backoff(1.0), clock=clock, sleep=clock.sleep)
    assert clock.sleeps == [1.0, 2.0, 4.0]


async def test_the_default_sleep_is_real() -> None:
    calls = 0

    async def probe() -> bool | None:
        nonlocal calls
        calls += 1
        return True if calls == 3 else None

    assert await poll_until(probe, every=0.01, timeout_s=5.0) is True


async def test_jitter_leaves_the_global_random_sequence_alone() -> None:
    """A seeded run's other users of ``random`` see the same numbers, retries or not."""
    random.seed(7)
    expected = random.random()
    random.seed(7)
    clock = FakeClock()

    async def attempt(n: int) -> None:
        raise OSError

    with pytest.raises(OSError):
        await clock.retry(attempt, attempts=4, backoff=Backoff(1.0, jitter=1.0), retry_on=OSError)
    assert all(0 < s <= w for s, w in zip(clock.sleeps, (1, 2, 4), strict=True))
    assert random.random() == expected

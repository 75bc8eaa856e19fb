"""Waiting and retrying, written once: a backoff schedule and the two loops that use it.

- :class:`Backoff` is the schedule, pure: the wait before retry ``n`` is ``base_s * factor **
  (n - 1)``, at most ``max_s``, less up to a share ``jitter`` of it drawn at random (clients that
  failed together then do not retry together). ``factor=1`` is a fixed interval.
- :func:`retry` calls a coroutine until it returns, retrying the exceptions it is told to after
  each wait, up to a number of attempts and a deadline; then the last exception propagates.
- :func:`poll_until` asks a probe until it answers (anything but None), waiting between asks,
  until a deadline (or forever); None when the deadline came first.

A deadline (``timeout_s`` from the first attempt) ends the waiting, not an attempt under way: no
wait runs past it (the last is cut short, so a last attempt starts at the deadline), and the
loop gives up after an attempt that ended at or after it. Both loops take the clock and the
sleep they use (by default ``time.monotonic`` and anyio's): the proxy passes its event loop's,
and tests a fake clock.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Backoff", "RetryNow", "poll_until", "retry"]

T = TypeVar("T")

Sleep = Callable[[float], Awaitable[object]]

#: Jitter's own random numbers: drawing from the global generator would shift the sequence that
#: a seeded run's other users of ``random`` see.
_JITTER = random.Random()


@dataclass(frozen=True)
class Backoff:
    """The wait before each retry: ``base_s``, times ``factor`` for each further one, at most
    ``max_s``, of which a share up to ``jitter`` (0 to 1) is taken off at random."""

    base_s: float
    max_s: float = math.inf
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and self.max_s >= 0 and self.factor >= 1):
            raise ValueError(f"{self}: need base_s >= 0, max_s >= 0 and factor >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"{self}: jitter is a share, in [0, 1]")

    def delay(self, retry: int, draw: float = 0.0) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first); ``draw`` is a
        uniform random number in [0, 1) that sets the jitter (0: none taken off)."""
        if retry < 1:
            raise ValueError(f"retry={retry}: retries count from 1")
        try:
            full = min(self.base_s * self.factor ** (retry - 1), self.max_s)
        except OverflowError:  # a replica failing for days: its count of failures keeps growing
            full = self.max_s if self.base_s > 0 else 0.0
        return full * (1.0 - self.jitter * draw)


class RetryNow(Exception):
    """Raised by an attempt of :func:`retry` whose failure is already dealt with: the next
    attempt starts at once (it still counts as an attempt; raised by the last, it propagates)."""


class _Pacer:
    """The waits between attempts: the schedule, the deadline, the clock and the sleep."""

    def __init__(
        self,
        backoff: Backoff,
        timeout_s: float | None,
        clock: Callable[[], float],
        sleep: Sleep | None,
        draw: Callable[[], float],
    ) -> None:
        self.backoff, self.clock, self.draw = backoff, clock, draw
        self.deadline = None if timeout_s is None else clock() + timeout_s
        if sleep is None:
            import anyio  # here, not above: the proxy runs on bare asyncio and loads no anyio

            sleep = anyio.sleep
        self.sleep = sleep

    def next_wait(self, retry: int) -> float | None:
        """The wait before retry number ``retry``; None when the deadline has passed."""
        wait = self.backoff.delay(retry, self.draw() if self.backoff.jitter else 0.0)
        if self.deadline is None:
            return wait
        left = self.deadline - self.clock()
        return None if left <= 0 else min(wait, left)


async def retry(
    attempt: Callable[[int], Awaitable[T]],
    *,
    attempts: int | None,
    backoff: Backoff,
    retry_on: type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool],
    timeout_s: float | None = None,
    on_retry: Callable[[int, Exception, float], object] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Sleep | None = None,
    draw: Callable[[], float] = _JITTER.random,
) -> T:
    """``await attempt(n)`` for n = 1, 2, ... until one returns its result. An exception that
    ``retry_on`` names (exception types, or a predicate) is retried after ``backoff``'s wait
    (:class:`RetryNow`: at once) while fewer than ``attempts`` (None: no limit) were made and
    the deadline has not passed; otherwise, and for any other exception, it propagates.
    ``on_retry(n, error, wait_s)`` hears each retry."""
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts={attempts}: need at least 1")
    retryable = _predicate(retry_on)
    pacer = _Pacer(backoff, timeout_s, clock, sleep, draw)
    n = 0
    while True:
        n += 1
        try:
            return await attempt(n)
        except Exception as exc:
            now = isinstance(exc, RetryNow)
            if not (now or retryable(exc)):
                raise
            wait = 0.0 if now else pacer.next_wait(n)
            if wait is None or (attempts is not None and n >= attempts):
                raise
            error = exc
        if on_retry is not None:
            on_retry(n, error, wait)
        if wait > 0:
            await pacer.sleep(wait)


def _predicate(
    retry_on: type[Exception] | tuple[type[Exception], ...] | Callable[[Exception], bool],
) -> Callable[[Exception], bool]:
    if isinstance(retry_on, type | tuple):
        types = retry_on
        return lambda exc: isinstance(exc, types)
    return retry_on


async def poll_until(
    probe: Callable[[], Awaitable[T | None]],
    *,
    every: Backoff | float,
    timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Sleep | None = None,
    draw: Callable[[], float] = _JITTER.random,
) -> T | None:
    """``await probe()`` until it returns something other than None, and return that; wait
    ``every`` seconds (or as that backoff says) between probes. None once ``timeout_s`` passed
    (None: never). An exception from the probe propagates (a probe that may fail transiently
    catches that and returns None)."""
    backoff = every if isinstance(every, Backoff) else Backoff(every, factor=1.0)
    pacer = _Pacer(backoff, timeout_s, clock, sleep, draw)
    n = 0
    while True:
        n += 1
        if (answer := await probe()) is not None:
            return answer
        wait = pacer.next_wait(n)
        if wait is None:
            return None
        await pacer.sleep(wait)

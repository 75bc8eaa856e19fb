"""The deadlines of many requests in flight, to a tenth of a second, on one timer.

Why: a timer per request (``loop.call_at``, then its cancel) costs uvloop a few microseconds, a
measurable share of the proxy's CPU per request; adding to and removing from a set costs a small
fraction of that. A deadline fires up to :data:`RESOLUTION_S` late.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from typing import Protocol

__all__ = ["RESOLUTION_S", "Deadlines", "Expiring"]

#: Deadlines due within the same tenth of a second fire together, at its end.
RESOLUTION_S = 0.1


class Expiring(Protocol):
    def on_deadline(self) -> None: ...


class Deadlines:
    """:meth:`add` an item with its deadline (loop time); its ``on_deadline`` is called once
    then, unless it was discarded from the slot :meth:`add` returned."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots: dict[int, set[Expiring]] = {}
        self.keys: list[int] = []  # heap of the slots' keys
        self.timer: asyncio.TimerHandle | None = None
        self.armed: int | None = None  # the key the timer is for

    def add(self, item: Expiring, when: float) -> set[Expiring]:
        key = math.ceil(when / RESOLUTION_S)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = set()
            heapq.heappush(self.keys, key)
            if self.armed is None or key < self.armed:
                self._arm(key)
        slot.add(item)
        return slot

    def _arm(self, key: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.armed = key
        self.timer = self.loop.call_at(key * RESOLUTION_S, self._tick)

    def _tick(self) -> None:
        self.timer = self.armed = None
        due = (self.loop.time() + 0.001) / RESOLUTION_S  # a timer may fire a hair early
        while self.keys and self.keys[0] <= due:
            for item in list(self.slots.pop(heapq.heappop(self.keys))):
                item.on_deadline()
        if self.keys and self.armed is None:
            self._arm(self.keys[0])

    def close(self) -> None:
        """Fire nothing more."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.armed = None
        self.slots.clear()
        self.keys.clear()

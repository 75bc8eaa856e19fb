"""Request ids and their outcomes: what ``retrieve_future`` polls.

Every call the SDK makes that returns an ``UntypedAPIFuture`` gets a request id here at once;
the work finishes later with a value or an error. ``retrieve_future`` waits on the id for a
while (a long poll: the SDK polls again at once after a ``try_again``), then answers the
outcome or ``try_again``. Finished outcomes are kept for the newest ``keep`` ids, so a poll the
SDK retries after a dropped connection still finds its answer.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio

__all__ = ["FutureTable", "Outcome"]


@dataclass(frozen=True)
class Outcome:
    """A finished request: ``value`` (what the route encodes), or ``error`` with its category
    (``user``: the request was wrong; ``server``: this service failed)."""

    value: Any = None
    error: str | None = None
    category: str = "user"


class FutureTable:
    def __init__(self, keep: int = 4096) -> None:
        self._keep = keep
        self._prefix = secrets.token_hex(4)
        self._count = itertools.count(1)
        self._pending: dict[str, anyio.Event] = {}
        self._done: OrderedDict[str, Outcome] = OrderedDict()

    def new(self) -> str:
        """A fresh request id, pending until :meth:`finish`."""
        rid = f"req-{self._prefix}-{next(self._count)}"
        self._pending[rid] = anyio.Event()
        return rid

    def finish(self, rid: str, outcome: Outcome) -> None:
        event = self._pending.pop(rid, None)
        self._done[rid] = outcome
        while len(self._done) > self._keep:
            self._done.popitem(last=False)
        if event is not None:
            event.set()

    def known(self, rid: str) -> bool:
        return rid in self._pending or rid in self._done

    async def wait(self, rid: str, timeout_s: float) -> Outcome | None:
        """The outcome of ``rid``, waiting up to ``timeout_s``; None if still pending. KeyError
        for an id this table never gave (or long forgot)."""
        if rid in self._done:
            return self._done[rid]
        event = self._pending[rid]
        with anyio.move_on_after(timeout_s):
            await event.wait()
        return self._done.get(rid)

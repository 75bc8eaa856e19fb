"""Request ids and their outcomes: what ``retrieve_future`` polls.

Every call the SDK makes that returns an ``UntypedAPIFuture`` gets a request id here at once;
the work finishes later with a value or an error. ``retrieve_future`` waits on the id for a
while (a long poll: the SDK polls again at once after a ``try_again``), then answers the
outcome or ``try_again``. Finished outcomes are kept for the newest ids (at most :data:`KEEP`,
holding at most :data:`KEEP_BYTES`), so a poll the SDK retries after a dropped connection still
finds its answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from asyncgrpo.errors import redact_text

__all__ = ["KEEP", "KEEP_BYTES", "FutureTable", "Outcome", "held_bytes", "server_failure"]


@dataclass(frozen=True)
class Outcome:
    """A finished request: ``value`` (what the route encodes), or ``error`` with its category
    (``user``: the request was wrong; ``server``: this service failed)."""

    value: Any = None
    error: str | None = None
    category: str = "user"


#: Finished outcomes kept, at most (the newest).
KEEP = 1024
#: Bytes of finished outcomes kept, at most (a forward_backward's logprobs and losses are 8
#: bytes per token): the newest 4,096 outcomes of any size were kept before, and three large
#: requests grew the service by half a gigabyte.
KEEP_BYTES = 256 * 1024 * 1024


def held_bytes(value: Any, depth: int = 0) -> int:
    """About how many bytes ``value`` holds: its arrays, strings and containers."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, str | bytes):
        return len(value) + 64
    if depth > 8:
        return 64
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list | tuple):
        return 64 + sum(held_bytes(v, depth + 1) for v in value)
    return 64


class FutureTable:
    """``keep``, ``keep_bytes``: finished outcomes are kept, the oldest forgotten first, while
    more than ``keep`` or holding more than ``keep_bytes`` (the newest is always kept)."""

    def __init__(self, keep: int = KEEP, keep_bytes: int = KEEP_BYTES) -> None:
        self._keep, self._keep_bytes = keep, keep_bytes
        self._held = 0
        self._sizes: dict[str, int] = {}
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
        self._held -= self._sizes.pop(rid, 0)
        self._done[rid] = outcome
        self._sizes[rid] = size = held_bytes(outcome.value) + held_bytes(outcome.error)
        self._held += size
        while len(self._done) > 1 and (
            len(self._done) > self._keep or self._held > self._keep_bytes
        ):
            old, _ = self._done.popitem(last=False)
            self._held -= self._sizes.pop(old, 0)
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


def server_failure(exc: BaseException, *, logged: bool = False) -> str:
    """One line for a failure of the service itself: for its client, the exception's type
    only (its text may name store paths); for the service's log, its text too, credentials
    redacted."""
    if logged:
        return f"{type(exc).__name__}: {redact_text(str(exc))}"
    return f"the server failed ({type(exc).__name__}); its log says why"

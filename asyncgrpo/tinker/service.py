"""The service's state and its one worker: sessions, training clients, queued requests.

HTTP handlers call :meth:`TinkerService.submit` with a job (a plain function over the engine)
and answer the request id at once; the worker runs one job at a time in a thread, chosen by the
:class:`~asyncgrpo.tinker.scheduling.FairQueue` (arrival order per client, round-robin across
clients), and records its outcome in the :class:`~asyncgrpo.tinker.futures.FutureTable`. A job
that fails is its own request's error (``user`` for a bad request, ``server`` otherwise, logged
in one line); the worker goes on with every other client's requests.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from asyncgrpo.tinker.futures import FutureTable, Outcome
from asyncgrpo.tinker.losses import LossInputError
from asyncgrpo.tinker.scheduling import FairQueue
from asyncgrpo.tinker.wire import WireError

__all__ = ["Session", "TinkerService", "TrainingModel"]

logger = logging.getLogger(__name__)

Job = Callable[[], Any]
#: Errors that are the request's fault; any other exception is the service's.
USER_ERRORS = (LossInputError, WireError)


@dataclass
class Session:
    session_id: str
    last_heartbeat: float
    finished: bool = False


@dataclass(frozen=True)
class TrainingModel:
    """A training client: its model id (also its adapter's name), session and rank."""

    model_id: str
    session_id: str
    rank: int


class TinkerService:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.futures = FutureTable()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self._queue: FairQueue[tuple[str, Job]] = FairQueue()
        self._waiting = anyio.Semaphore(0)

    def new_session(self) -> Session:
        session = Session(session_id=f"s{secrets.token_hex(6)}", last_heartbeat=time.monotonic())
        self.sessions[session.session_id] = session
        return session

    def submit(self, client: str, job: Job) -> str:
        """Queue ``job`` under ``client``; its request id, pending until the job ran."""
        rid = self.futures.new()
        self._queue.put(client, (rid, job))
        self._waiting.release()
        return rid

    def done(self, value: Any) -> str:
        """A request id that is already finished with ``value`` (no work to queue)."""
        rid = self.futures.new()
        self.futures.finish(rid, Outcome(value=value))
        return rid

    async def run(self) -> None:
        """Run queued jobs one at a time, forever (cancel to stop)."""
        while True:
            await self._waiting.acquire()
            popped = self._queue.pop()
            if popped is None:
                continue
            client, (rid, job) = popped
            self.futures.finish(rid, await self._run_one(client, job))

    async def _run_one(self, client: str, job: Job) -> Outcome:
        try:
            return Outcome(value=await anyio.to_thread.run_sync(job))
        except USER_ERRORS as exc:
            logger.warning("request of %s refused: %s", client, exc)
            return Outcome(error=str(exc), category="user")
        except Exception as exc:  # the service's own failure: one line, keep serving
            logger.error("request of %s failed: %s: %s", client, type(exc).__name__, exc)
            return Outcome(error=f"the server failed: {type(exc).__name__}: {exc}",
                           category="server")  # fmt: skip

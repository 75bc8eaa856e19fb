"""The service's state and its one worker: sessions, training clients, queued requests.

HTTP handlers call :meth:`TinkerService.submit` with a job (a plain function over the engine)
and answer the request id at once; the worker runs one job at a time in a thread, chosen by the
:class:`~asyncgrpo.tinker.scheduling.FairQueue` (arrival order per client, round-robin across
clients), and records its outcome in the :class:`~asyncgrpo.tinker.futures.FutureTable`. A job
that fails is its own request's error (``user`` for a bad request, ``server`` otherwise, logged
in one line); the worker goes on with every other client's requests.
A :class:`~asyncgrpo.errors.RankError` (a data-parallel rank is gone) instead stops the
service: the ranks' adapters can no longer be kept equal.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from asyncgrpo.errors import ConfigError, NotFound, RankError
from asyncgrpo.tinker.engine import StateError
from asyncgrpo.tinker.futures import FutureTable, Outcome
from asyncgrpo.tinker.losses import LossInputError
from asyncgrpo.tinker.scheduling import FairQueue
from asyncgrpo.tinker.wire import WireError

__all__ = [
    "Job",
    "Session",
    "TinkerService",
    "TrainingModel",
    "adapter_name",
    "expired_sessions",
    "in_thread",
]

logger = logging.getLogger(__name__)

#: A queued request's work: a coroutine function (:func:`in_thread` wraps torch work).
Job = Callable[[], Awaitable[Any]]
#: Errors that are the request's fault; any other exception is the service's.
USER_ERRORS = (LossInputError, WireError, StateError, NotFound, ConfigError)


@dataclass
class Session:
    session_id: str
    last_heartbeat: float
    finished: bool = False


@dataclass(frozen=True)
class TrainingModel:
    """A training client: its model id, session and rank."""

    model_id: str
    session_id: str
    rank: int

    @property
    def adapter(self) -> str:
        """Its adapter's name (in peft, the store, the proxy and vLLM): the model id with
        anything but letters, digits, '_' and '-' made '-' (the SDK's ids hold ':')."""
        return adapter_name(self.model_id)


def adapter_name(model_id: str) -> str:
    """The adapter (and training run) name of a model id: anything but letters, digits, '_'
    and '-' made '-'."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", model_id)


def expired_sessions(sessions: Iterable[Session], now: float, timeout_s: float) -> list[str]:
    """The open sessions whose last sign of life is more than ``timeout_s`` before ``now``."""
    return [s.session_id for s in sessions
            if not s.finished and now - s.last_heartbeat > timeout_s]  # fmt: skip


def in_thread(fn: Callable[[], Any]) -> Job:
    """``fn`` as a job run in a worker thread (the event loop keeps serving meanwhile)."""
    return lambda: anyio.to_thread.run_sync(fn)


class TinkerService:
    """``session_timeout_s``: a session with no heartbeat (nor request) for that long ends as
    if the SDK had finished it; ``max_clients``: the most training clients alive at once."""

    def __init__(self, engine: Any, states: Any, sampler: Any = None, *,
                 session_timeout_s: float = 300.0, max_clients: int = 16) -> None:  # fmt: skip
        self.engine = engine
        self.states = states
        self.sampler = sampler
        self.session_timeout_s = session_timeout_s
        self.max_clients = max_clients
        self.futures = FutureTable()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self._queue: FairQueue[tuple[str, Job]] = FairQueue()
        self._waiting = anyio.Semaphore(0)
        self._tasks: TaskGroup

    def new_session(self) -> Session:
        session = Session(session_id=f"s{secrets.token_hex(6)}", last_heartbeat=time.monotonic())
        self.sessions[session.session_id] = session
        return session

    def is_open(self, session_id: str) -> bool:
        session = self.sessions.get(session_id)
        return session is not None and not session.finished

    def touch(self, session_id: str) -> None:
        """A sign of life of the session (a heartbeat, or a request of one of its clients)."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_heartbeat = time.monotonic()

    def add_model(self, model: TrainingModel) -> None:
        """Count ``model`` among the live clients; WireError naming the cap when it is full."""
        if model.model_id not in self.models and len(self.models) >= self.max_clients:
            raise WireError(f"this service already holds {len(self.models)} training clients, "
                            f"its max_training_clients (--max-training-clients): close a "
                            "ServiceClient whose clients are done, or raise the cap")  # fmt: skip
        self.models[model.model_id] = model

    def end_session(self, session_id: str, why: str) -> None:
        """End the session: each of its clients leaves after its queued requests (its versions
        leave the replicas, its LoRA slots go back, its adapter and optimizer leave the
        trainer). A heartbeat of it is answered 410 from then on."""
        session = self.sessions.get(session_id)
        if session is None or session.finished:
            return
        session.finished = True
        ended = [m for m in self.models.values() if m.session_id == session_id]
        logger.info("session %s %s: %d training clients end", session_id, why, len(ended))
        for model in ended:
            del self.models[model.model_id]
            self.submit(model.model_id, self._remover(model))

    def _remover(self, model: TrainingModel) -> Job:
        async def job() -> None:
            if self.sampler is not None:
                await self.sampler.release(model.adapter)
            await in_thread(lambda: self.engine.remove(model.adapter))()
            logger.info("training client %s ended with its session", model.model_id)

        return job

    async def _expire(self) -> None:
        """End every session that stopped showing signs of life, checking a few times per
        timeout."""
        while True:
            await anyio.sleep(min(self.session_timeout_s / 4, 10.0))
            stale = expired_sessions(self.sessions.values(), time.monotonic(),
                                     self.session_timeout_s)  # fmt: skip
            for session_id in stale:
                self.end_session(session_id, f"expired ({self.session_timeout_s:g} s without "
                                             "a heartbeat)")  # fmt: skip

    def submit(self, client: str, job: Job) -> str:
        """Queue ``job`` under ``client``; its request id, pending until the job ran."""
        rid = self.futures.new()
        self._queue.put(client, (rid, job))
        self._waiting.release()
        return rid

    def spawn(self, job: Job) -> str:
        """Run ``job`` now, beside the queue (sampling: it needs no trainer); its request id."""
        rid = self.futures.new()
        self._tasks.start_soon(self._finish, "sampling", rid, job)
        return rid

    def done(self, value: Any) -> str:
        """A request id that is already finished with ``value`` (no work to queue)."""
        rid = self.futures.new()
        self.futures.finish(rid, Outcome(value=value))
        return rid

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run queued jobs one at a time and spawned ones beside them, forever (cancel to
        stop); ready once it can take jobs."""
        async with anyio.create_task_group() as self._tasks:
            self._tasks.start_soon(self._expire)
            if getattr(self.engine, "keepalive_s", None):
                self._tasks.start_soon(self._keepalive)
            task_status.started()
            while True:
                await self._waiting.acquire()
                popped = self._queue.pop()
                if popped is None:
                    continue
                client, (rid, job) = popped
                await self._finish(client, rid, job)

    async def _keepalive(self) -> None:
        """Ping the data-parallel ranks when idle (a RankError here stops the service)."""
        every = self.engine.keepalive_s
        while True:
            await anyio.sleep(max(every - self.engine.idle_s(), 0.1))
            if self.engine.idle_s() >= every:
                await in_thread(self.engine.ping)()

    async def _finish(self, client: str, rid: str, job: Job) -> None:
        try:
            outcome = await self._run_one(client, job)
        except RankError as exc:  # a data-parallel rank is gone: the service cannot go on
            logger.error("request of %s failed: %s", client, exc)
            self.futures.finish(rid, Outcome(error=f"the server failed: {exc}", category="server"))
            raise
        self.futures.finish(rid, outcome)

    async def _run_one(self, client: str, job: Job) -> Outcome:
        try:
            return Outcome(value=await job())
        except RankError:
            raise
        except USER_ERRORS as exc:
            logger.warning("request of %s refused: %s", client, exc)
            return Outcome(error=str(exc), category="user")
        except Exception as exc:  # the service's own failure: one line, keep serving
            logger.error("request of %s failed: %s: %s", client, type(exc).__name__, exc)
            return Outcome(error=f"the server failed: {type(exc).__name__}: {exc}",
                           category="server")  # fmt: skip

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

import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import anyio
import numpy as np
from anyio.abc import TaskGroup, TaskStatus

from asyncgrpo.errors import ConfigError, NotFound, RankError
from asyncgrpo.tinker.engine import StateError
from asyncgrpo.tinker.futures import FutureTable, Outcome, server_failure
from asyncgrpo.tinker.losses import LOSSES, LossInputError, SamplerGap
from asyncgrpo.tinker.provenance import ProvenanceError, StabilityRecords, sampled_mask
from asyncgrpo.tinker.sampling import SlotsFull
from asyncgrpo.tinker.scheduling import FairQueue
from asyncgrpo.tinker.wire import FwdBwdRequest, WireError

__all__ = [
    "MAX_SAMPLING",
    "Job",
    "QueueFull",
    "Session",
    "TinkerService",
    "TrainingModel",
    "adapter_name",
    "expired_sessions",
    "in_thread",
    "with_provenance",
]

logger = logging.getLogger(__name__)

#: A queued request's work: a coroutine function (:func:`in_thread` wraps torch work).
Job = Callable[[], Awaitable[Any]]
#: Errors that are the request's fault; any other exception is the service's.
USER_ERRORS = (LossInputError, WireError, StateError, NotFound, ConfigError, ProvenanceError)
#: Sample requests in flight at once, all clients together (each holds its prompt meanwhile).
MAX_SAMPLING = 1024
#: The SDK heartbeats every this many seconds (``InternalClientHolder._session_heartbeat``).
SDK_HEARTBEAT_S = 10.0


class QueueFull(Exception):
    """A client's request refused because the client has its most requests queued (429)."""


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
    return [s.session_id for s in sessions if not s.finished and now - s.last_heartbeat > timeout_s]


def with_provenance(
    request: FwdBwdRequest, records: StabilityRecords, session_id: str, now: float
) -> FwdBwdRequest:
    """``request`` (checked by the engine) with what its datums' provenance says: the sampled
    positions each trains on and, for a loss that reads the sampler's record
    (``stable_reinforce``), the recorded sampler logprobs in place of the datum's
    ``logprobs``, each span checked against the record it names. A loss that does not read the
    record uses no more than which positions were sampled, so its spans may name sequences
    sampled without ``record_stability_info``."""
    spec = LOSSES[request.loss_fn]
    data = []
    for i, datum in enumerate(request.data):
        if datum.target_spans is None or datum.input_spans is None:
            data.append(datum)
            continue
        trained = sampled_mask(datum.target_spans)
        inputs = datum.inputs
        if spec.provenance:
            records.resolve(datum.input_spans, datum.tokens, session_id, i, now, what="model_input")
            targets = datum.inputs["target_tokens"]
            # prompt targets carry no loss; rl_loop pads them with 0, so they are not compared
            recorded = records.resolve(
                datum.target_spans, targets, session_id, i, now, check_prompt=False
            )
            off = np.flatnonzero((np.asarray(inputs["advantages"]) != 0) & (trained == 0))
            if off.size:
                raise ProvenanceError(
                    f"datum {i}: advantages[{int(off[0])}] is nonzero on a prompt position: "
                    f"{request.loss_fn} trains only the sampled tokens, so give them zero "
                    "advantage elsewhere"
                )
            inputs = {**inputs, "logprobs": recorded}
        data.append(dataclasses.replace(datum, inputs=inputs, trained=trained))
    return dataclasses.replace(request, data=data)


def in_thread(fn: Callable[[], Any]) -> Job:
    """``fn`` as a job run in a worker thread (the event loop keeps serving meanwhile)."""
    return lambda: anyio.to_thread.run_sync(fn)


@dataclass(eq=False, repr=False)
class TinkerService:
    """``session_timeout_s``: a session with no heartbeat (nor request) for that long ends as
    if the SDK had finished it; ``max_clients``: the most training clients alive at once;
    ``max_queued``: the most requests one client has queued."""

    engine: Any
    states: Any
    sampler: Any = None
    _: KW_ONLY
    session_timeout_s: float = 30.0
    max_clients: int = 16
    max_queued: int = 64
    futures: FutureTable = field(default_factory=FutureTable, init=False)
    sessions: dict[str, Session] = field(default_factory=dict, init=False)
    models: dict[str, TrainingModel] = field(default_factory=dict, init=False)
    #: sequences sampled with record_stability_info, for the losses that read them
    records: StabilityRecords = field(default_factory=StabilityRecords, init=False)
    #: per training client, the sampler-vs-trainer gap of its datums since its last step
    gaps: dict[str, SamplerGap] = field(default_factory=dict, init=False)
    #: clients whose session ended and whose slots are on their way back
    _leaving: set[str] = field(default_factory=set, init=False)
    _queue: FairQueue[tuple[str, Job]] = field(default_factory=FairQueue, init=False)
    _waiting: anyio.Semaphore = field(default_factory=lambda: anyio.Semaphore(0), init=False)
    _sampling: int = field(default=0, init=False)  # sampling jobs in flight
    _tasks: TaskGroup = field(init=False)

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
        """Count ``model`` among the live clients; WireError naming the cap when it is full, or
        when its session is no longer open (it ended while the request waited: nothing would
        ever remove the client)."""
        if not self.is_open(model.session_id):
            raise WireError(
                f"session {model.session_id!r} ended before training client "
                f"{model.model_id!r} was made: make a new ServiceClient"
            )
        if model.model_id not in self.models and len(self.models) >= self.max_clients:
            raise WireError(
                f"this service already holds {len(self.models)} training clients, "
                f"its max_training_clients (--max-training-clients): close a "
                "ServiceClient whose clients are done, or raise the cap"
            )
        self.models[model.model_id] = model

    def end_session(self, session_id: str, why: str, *, drop_queued: bool = False) -> None:
        """End the session: each of its clients leaves after its queued requests, or at once
        with ``drop_queued`` (they fail naming ``why``): its versions leave the replicas, its
        LoRA slots go back, its adapter and optimizer leave the trainer. A heartbeat of it is
        answered 410 from then on."""
        session = self.sessions.get(session_id)
        if session is None or session.finished:
            return
        session.finished = True
        self.records.drop_session(session_id)
        ended = [m for m in self.models.values() if m.session_id == session_id]
        logger.info("session %s %s: %d training clients end", session_id, why, len(ended))
        for model in ended:
            del self.models[model.model_id]
            self.gaps.pop(model.model_id, None)
            if drop_queued:
                for rid, _ in self._queue.drop(model.model_id):
                    error = f"the session ended before this request ran: it {why}"
                    self.futures.finish(rid, Outcome(error=error, category="user"))
            self._leaving.add(model.model_id)
            self.submit(model.model_id, self._remover(model))

    def is_live(self, model: TrainingModel) -> bool:
        """Whether ``model`` is still one of the live clients (its session did not end)."""
        return model.model_id in self.models and self.is_open(model.session_id)

    def discard(self, model: TrainingModel) -> None:
        """Undo a client being made that failed or whose session ended meanwhile: it leaves the
        live clients and everything it may have booked goes back, in its turn (releasing slots
        and removing an adapter that were never taken is a no-op)."""
        self.models.pop(model.model_id, None)
        self.gaps.pop(model.model_id, None)
        self._leaving.add(model.model_id)
        self.submit(model.model_id, self._remover(model))

    def _unproven_holders(self, besides: str, since: float) -> list[str]:
        """The open sessions but ``besides`` holding training clients that have shown no sign of
        life since ``since``: each may be a program that ended without closing its
        ServiceClient, whose slots come back when it expires."""
        holders = {m.session_id for m in self.models.values()} - {besides}
        return sorted(
            s for s in holders if self.is_open(s) and self.sessions[s].last_heartbeat < since
        )

    async def book_slots(self, model: TrainingModel) -> None:
        """Book a new client's LoRA slots on the proxy. While the replicas' slots are taken by
        sessions not yet heard from since this call began (the SDK heartbeats every 10 s, so a
        live one speaks within that), wait for them to speak or expire, at most
        ``session_timeout_s`` and a heartbeat period; then refused, naming this service's
        flags."""
        started = time.monotonic()
        deadline = started + self.session_timeout_s + 2 * SDK_HEARTBEAT_S
        waited = False
        while True:
            try:
                await self.sampler.book(model.adapter)
                return
            except SlotsFull:
                silent = self._unproven_holders(model.session_id, started)
                if not (silent or self._leaving) or time.monotonic() > deadline:
                    raise
                if not waited:
                    logger.info(
                        "training client %s waits for LoRA slots: sessions %s hold them "
                        "and have not spoken since it asked (they expire %g s after "
                        "their last heartbeat)",
                        model.model_id,
                        ", ".join(silent),
                        self.session_timeout_s,
                    )
                    waited = True
                await anyio.sleep(0.5)
                self.expire_now()

    def _remover(self, model: TrainingModel) -> Job:
        async def job() -> None:
            try:
                try:
                    if self.sampler is not None:
                        await self.sampler.release(model.adapter)
                finally:  # the adapter leaves the trainer even if the proxy did not answer
                    await in_thread(lambda: self.engine.remove(model.adapter))()
            finally:
                self._leaving.discard(model.model_id)
            logger.info("training client %s ended with its session", model.model_id)

        return job

    async def _expire(self) -> None:
        """End every session that stopped showing signs of life, checking a few times per
        timeout."""
        while True:
            await anyio.sleep(min(self.session_timeout_s / 4, 5.0))
            self.expire_now()

    def expire_now(self) -> None:
        """End the sessions past ``session_timeout_s`` without a sign of life, dropping their
        queued requests (nobody is left to read their answers)."""
        stale = expired_sessions(self.sessions.values(), time.monotonic(), self.session_timeout_s)
        for session_id in stale:
            why = f"expired ({self.session_timeout_s:g} s without a heartbeat)"
            self.end_session(session_id, why, drop_queued=True)
        self.prune()

    def prune(self) -> None:
        """Forget the ended sessions (a heartbeat of an unknown one is answered 410 too), and
        the sampler gaps of clients that are gone."""
        self.sessions = {k: v for k, v in self.sessions.items() if not v.finished}
        self.gaps = {k: v for k, v in self.gaps.items() if k in self.models}

    def check_room(self, client: str) -> None:
        """QueueFull when ``client`` has ``max_queued`` requests queued already."""
        if self._queue.count(client) >= self.max_queued:
            raise QueueFull(
                f"training client {client!r} has {self.max_queued} requests queued, "
                "this service's max_queued_per_client: wait for their results"
            )

    def submit(self, client: str, job: Job, *, bounded: bool = False) -> str:
        """Queue ``job`` under ``client``; its request id, pending until the job ran.
        ``bounded`` (a client's request): QueueFull when the client has ``max_queued`` jobs
        queued already."""
        if bounded:
            self.check_room(client)
        rid = self.futures.new()
        self._queue.put(client, (rid, job))
        self._waiting.release()
        return rid

    async def in_turn(self, client: str, job: Job) -> Any:
        """Run ``job`` in ``client``'s turn on the worker (after its queued requests, never beside
        another job's torch work) and return its value or raise its error: for work spawned
        beside the queue (:meth:`spawn`) that must wait without holding the worker, such as a
        new client booking LoRA slots, and then touch the engine."""
        done, box = anyio.Event(), {}

        async def turn() -> None:
            try:
                box["value"] = await job()
            except RankError:
                done.set()
                raise  # the service stops: the worker sees it
            except Exception as exc:
                box["error"] = exc
            finally:
                done.set()

        self.submit(client, turn)
        await done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def spawn(self, job: Job, label: str = "sampling") -> str:
        """Run ``job`` now, beside the queue (sampling, which needs no trainer, or work that may
        wait before it touches the trainer: :meth:`in_turn`); its request id. Sampling jobs are
        at most :data:`MAX_SAMPLING` at once (QueueFull beyond): each holds its prompt until
        the replicas answer."""
        if label == "sampling":
            if self._sampling >= MAX_SAMPLING:
                raise QueueFull(
                    f"this service has {MAX_SAMPLING} sample requests in flight: "
                    "wait for their results"
                )
            self._sampling += 1
        rid = self.futures.new()
        self._tasks.start_soon(self._finish, label, rid, job)
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
            logger.error("request of %s failed: %s", client, server_failure(exc, logged=True))
            self.futures.finish(rid, Outcome(error=server_failure(exc), category="server"))
            raise
        finally:
            if client == "sampling":
                self._sampling -= 1
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
            logger.error("request of %s failed: %s", client, server_failure(exc, logged=True))
            return Outcome(error=server_failure(exc), category="server")

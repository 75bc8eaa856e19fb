"""The index of training runs and their checkpoints: what the SDK's ``RestClient`` lists, and
what resolves a ``tinker://`` path after the service restarts.

One small JSON document per training run (its base model, LoRA shape, times, and each of its
checkpoints: kind, name, time, size, expiry, user metadata, and where its files are) at
``tinker-runs/<run_id>.json`` in the service's transport, beside the files themselves. The
service is the only writer; a lock orders its read-modify-writes. A checkpoint past its TTL is
gone: it is listed no more, its path is refused as unknown, and its files are deleted from the
transport the first time the index meets it expired.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import anyio

from asyncgrpo.errors import IntegrityError, NotFound
from asyncgrpo.store.documents import read_document
from asyncgrpo.tinker.wire import WireError
from asyncgrpo.transport.base import Transport, join_key

__all__ = ["Checkpoint", "CheckpointIndex", "Run", "check_ttl", "parse_path"]

Kind = Literal["training", "sampler"]
#: The path segment of each kind (``tinker://<run>/<segment>/<name>``).
SEGMENTS: dict[str, Kind] = {"weights": "training", "sampler_weights": "sampler"}
_PATH = re.compile(r"tinker://([A-Za-z0-9][A-Za-z0-9_.-]*)/([a-z_]+)/([^/]+)")
logger = logging.getLogger(__name__)
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: The longest TTL accepted, as Tinker's (10 years).
MAX_TTL_S = 10 * 365 * 24 * 3600
PREFIX = "tinker-runs"


def parse_path(path: str) -> tuple[str, Kind, str]:
    """``(run_id, kind, name)`` of a checkpoint path; WireError naming the form if not one."""
    found = _PATH.fullmatch(path)
    if found is None or found.group(2) not in SEGMENTS:
        raise WireError(
            f"{path!r} is not a checkpoint path: give one that save_state or "
            "save_weights_for_sampler returned (tinker://<training_run_id>/weights/"
            "<name> or tinker://<training_run_id>/sampler_weights/<name>)"
        )
    return found.group(1), SEGMENTS[found.group(2)], found.group(3)


def check_ttl(ttl_seconds: int | None) -> None:
    """WireError naming the range unless ``ttl_seconds`` is None or 1 s to 10 years."""
    if ttl_seconds is not None and not 1 <= ttl_seconds <= MAX_TTL_S:
        raise WireError(
            f"ttl_seconds={ttl_seconds}: give 1 to {MAX_TTL_S} (10 years), or None "
            "for a checkpoint that never expires"
        )


@dataclass
class Checkpoint:
    """One checkpoint of a run; ``where``: its step in the state store (training) or its
    adapter version (sampler)."""

    kind: Kind
    name: str
    where: int
    created: float
    size_bytes: int | None = None
    expires_at: float | None = None
    user_metadata: dict[str, str] | None = None

    @property
    def checkpoint_id(self) -> str:
        segment = next(s for s, k in SEGMENTS.items() if k == self.kind)
        return f"{segment}/{self.name}"

    def path(self, run_id: str) -> str:
        return f"tinker://{run_id}/{self.checkpoint_id}"


@dataclass
class Run:
    """A training run (one training client, as its adapter's name) and its checkpoints."""

    run_id: str
    base_model: str
    rank: int
    train_mlp: bool
    train_attn: bool
    created: float
    last_request: float
    checkpoints: list[Checkpoint] = field(default_factory=list)

    def find(self, kind: Kind, name: str) -> Checkpoint | None:
        return next((c for c in self.checkpoints if c.kind == kind and c.name == name), None)

    def latest(self, kind: Kind) -> Checkpoint | None:
        mine = [c for c in self.checkpoints if c.kind == kind]
        return max(mine, key=lambda c: c.created) if mine else None


#: The most a run's index entry (``tinker-runs/<run_id>.json``) may hold: about 12,000
#: checkpoints.
MAX_RUN_BYTES = 4 * 1024 * 1024


def _run_of(data: dict[str, Any], where: str) -> Run:
    """The run an index entry holds; IntegrityError naming it when it is not one (anyone who
    can write the store chose its bytes)."""
    try:
        for name, kind in (
            ("run_id", str),
            ("rank", int),
            ("created", float),
            ("last_request", float),
        ):
            if not isinstance(data.get(name), int | float if kind is float else kind):
                raise TypeError(f"{name} is not a {kind.__name__}")
        checkpoints = [Checkpoint(**c) for c in data.pop("checkpoints", [])]
        for c in checkpoints:
            if not (
                isinstance(c.name, str)
                and isinstance(c.where, int)
                and isinstance(c.created, int | float)
            ):
                raise TypeError(f"checkpoint {c.name!r} is malformed")
        return Run(**data, checkpoints=checkpoints)
    except (TypeError, ValueError, AttributeError) as exc:
        raise IntegrityError(f"{where} is not a training run: {exc}") from None


#: Deletes a checkpoint's files from the transport (given its run id and the checkpoint).
Deleter = Callable[[str, Checkpoint], Awaitable[None]]


class CheckpointIndex:
    """Runs and checkpoints in the transport; ``delete_files`` removes a checkpoint's files."""

    def __init__(
        self, transport: Transport, delete_files: Deleter, clock: Callable[[], float] = time.time
    ) -> None:
        self.transport = transport
        self.delete_files = delete_files
        self.clock = clock
        self._lock = anyio.Lock()

    def _key(self, run_id: str) -> str:
        return join_key(PREFIX, f"{run_id}.json")

    async def _read(self, run_id: str) -> Run | None:
        if not _RUN_ID.fullmatch(run_id):
            return None
        key = self._key(run_id)
        try:
            data = await read_document(self.transport, key, max_bytes=MAX_RUN_BYTES)
        except NotFound:
            return None
        return _run_of(data, f"{PREFIX}/{run_id}.json")

    async def _write(self, run: Run) -> None:
        await self.transport.put(self._key(run.run_id), json.dumps(asdict(run), indent=1).encode())

    async def _expire(self, run: Run) -> Run:
        """Drop (and delete the files of) ``run``'s checkpoints past their TTL."""
        now = self.clock()
        dead = [c for c in run.checkpoints if c.expires_at is not None and c.expires_at <= now]
        if dead:
            run.checkpoints = [c for c in run.checkpoints if c not in dead]
            for checkpoint in dead:
                await self.delete_files(run.run_id, checkpoint)
            await self._write(run)
        return run

    async def start_run(
        self, run_id: str, base_model: str, rank: int, *, train_mlp: bool, train_attn: bool
    ) -> None:
        """Record a new training run (a run already recorded keeps its checkpoints)."""
        async with self._lock:
            now = self.clock()
            run = await self._read(run_id) or Run(
                run_id, base_model, rank, train_mlp, train_attn, created=now, last_request=now
            )
            run.last_request = now
            await self._write(run)

    async def add(self, run_id: str, checkpoint: Checkpoint, ttl_seconds: int | None) -> str:
        """Record ``checkpoint`` of the run (in place of one of the same kind and name); its
        path."""
        async with self._lock:
            run = await self._read(run_id)
            if run is None:
                raise NotFound(f"no training run {run_id!r} in the index")
            if ttl_seconds is not None:
                checkpoint.expires_at = checkpoint.created + ttl_seconds
            run.checkpoints = [
                c for c in run.checkpoints if (c.kind, c.name) != (checkpoint.kind, checkpoint.name)
            ]
            run.checkpoints.append(checkpoint)
            run.last_request = self.clock()
            await self._write(run)
        return checkpoint.path(run_id)

    async def run(self, run_id: str) -> Run:
        """The run, without its expired checkpoints; NotFound naming the fix if none."""
        async with self._lock:
            run = await self._read(run_id)
            if run is None:
                raise NotFound(
                    f"no training run {run_id!r} on this service: give a "
                    "training client's model_id (list_training_runs lists them)"
                )
            return await self._expire(run)

    async def runs(self) -> list[Run]:
        """Every run, newest first."""
        ids = [
            info.key.rsplit("/", 1)[-1].removesuffix(".json")
            async for info in self.transport.list(PREFIX + "/")
            if info.key.endswith(".json")
        ]
        runs = []
        for run_id in ids:
            try:
                runs.append(await self.run(run_id))
            except NotFound:  # deleted meanwhile
                continue
            except IntegrityError as exc:  # one broken entry made every listing fail
                logger.warning("training run %s left out of the listing: %s", run_id, exc)
        return sorted(runs, key=lambda r: r.created, reverse=True)

    async def resolve(self, path: str) -> tuple[Run, Checkpoint]:
        """The run and live checkpoint ``path`` names; NotFound naming the fix if none."""
        run_id, kind, name = parse_path(path)
        try:
            run = await self.run(run_id)
        except NotFound as exc:
            raise NotFound(f"no checkpoint at {path!r}: {exc}") from None
        checkpoint = run.find(kind, name)
        if checkpoint is None:
            saver = "save_state" if kind == "training" else "save_weights_for_sampler"
            raise NotFound(
                f"no checkpoint at {path!r} (never saved, deleted, or past its TTL): "
                f"save it with {saver}, or list_checkpoints({run_id!r}) for the "
                "ones there are"
            )
        return run, checkpoint

    async def delete(self, path: str) -> None:
        """Remove the checkpoint ``path`` names from the index and its files from the
        transport."""
        run, checkpoint = await self.resolve(path)
        async with self._lock:
            fresh = await self._read(run.run_id) or run
            fresh.checkpoints = [
                c
                for c in fresh.checkpoints
                if (c.kind, c.name) != (checkpoint.kind, checkpoint.name)
            ]
            await self._write(fresh)
        await self.delete_files(run.run_id, checkpoint)

    async def set_ttl(self, path: str, ttl_seconds: int | None) -> None:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never)."""
        check_ttl(ttl_seconds)
        run, checkpoint = await self.resolve(path)
        async with self._lock:
            fresh = await self._read(run.run_id) or run
            found = fresh.find(checkpoint.kind, checkpoint.name)
            if found is not None:
                found.expires_at = None if ttl_seconds is None else self.clock() + ttl_seconds
                await self._write(fresh)

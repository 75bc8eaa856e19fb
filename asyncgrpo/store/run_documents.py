"""A run's own documents in its transport, written and read here only.

Beside the adapter versions (:class:`~asyncgrpo.store.adapters.AdapterStore`), the checkpoints
(:class:`~asyncgrpo.store.checkpoints.CheckpointStore`) and the rollout channel, a run keeps::

    run.json      {"run_name", "run_id", "created"}  written once, create-only: the run's id, so
                  a restarted run keeps its adapter names and continues their numbering
    policy.json   {"adapter", "version", "time"}     rewritten by the trainer after each sync:
                  the version split rollout processes generate under
    done.json     {"step", "version"}                written by the trainer when it finishes:
                  the split rollout processes stop

Each is read bounded and checked (:func:`~asyncgrpo.store.documents.read_document`): a
malformed one is an :class:`~asyncgrpo.errors.IntegrityError` naming it, never a ``KeyError``.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.errors import AlreadyExists, ConfigError, IntegrityError, NotFound
from asyncgrpo.retry import poll_until
from asyncgrpo.store.documents import field, read_document
from asyncgrpo.transport import Transport, open_transport

log = logging.getLogger(__name__)

RUN_KEY = "run.json"
POLICY_KEY = "policy.json"
DONE_KEY = "done.json"
#: Where a finished run leaves its final version as a plain PEFT directory, in its run directory.
FINAL_ADAPTER_DIR = "adapter"


@dataclass
class RunResult:
    """What a finished run left in its transport and run directory."""

    run_dir: Path
    adapter_prefix: str  #: vLLM names are ``<adapter_prefix>-v<N>``
    steps: int
    final_version: int
    resumed_from_step: int | None
    transport_url: str
    rank: int = 0  #: data-parallel rank; on ranks > 0 ``final_version`` is -1 (not tracked)
    #: the final version as a plain PEFT directory, ``<run_dir>/adapter`` (rank 0 only)
    adapter_dir: Path | None = None
    #: the run was already at ``trainer.max_steps``: nothing was started, trained or published
    up_to_date: bool = False


def open_run_transport(url: str) -> Transport | None:
    """The transport of a run that may have started, to read: None when it is a directory
    that does not exist (nothing has run there; reading must not create it)."""
    local = "://" not in url or url.startswith("file://")
    try:
        return open_transport(url, **({"create": False} if local else {}))
    except ConfigError:
        if local:
            return None
        raise


def _policy(doc: dict[str, Any], where: str) -> tuple[str, int]:
    """(adapter name, version) of a ``policy.json``; :class:`IntegrityError` naming ``where``
    unless they are a string and an integer >= 0."""
    version = field(doc, "version", int, where)
    if version < 0:
        raise IntegrityError(f"{where}: version {version} is negative")
    return field(doc, "adapter", str, where), version


class RunStore:
    """The run's documents (``run.json``, ``policy.json``, ``done.json``) in ``transport``."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def existing_run_id(self, run_name: str) -> str:
        """The id of a run that has started here; :class:`ConfigError` when none has (or
        another run owns this transport)."""
        try:
            stored = await read_document(self.transport, RUN_KEY)
        except NotFound:
            raise ConfigError(
                f"no run has started in {self.transport.url} ({RUN_KEY} is missing): train "
                "first, or give the config of the run to evaluate"
            ) from None
        if stored.get("run_name") != run_name:
            raise ConfigError(
                f"transport {self.transport.url} holds run {stored.get('run_name')!r}, not "
                f"{run_name!r}: give that run's config"
            )
        return field(stored, "run_id", str, f"{self.transport.url}/{RUN_KEY}")

    async def run_id(self, run_name: str) -> str:
        """The run's id, created once (create-only write: two racing starts agree on one id)."""
        doc = {"run_name": run_name, "run_id": secrets.token_hex(4), "created": time.time()}
        try:
            await self.transport.put(RUN_KEY, json.dumps(doc).encode(), mode="create")
        except AlreadyExists:
            pass
        stored = await read_document(self.transport, RUN_KEY)
        where = f"{self.transport.url}/{RUN_KEY}"
        if (held := field(stored, "run_name", str, where)) != run_name:
            raise ConfigError(
                f"transport {self.transport.url} holds run {held!r}, not {run_name!r}: give "
                "each run its own transport_url (or prefix)"
            )
        return field(stored, "run_id", str, where)

    async def write_policy(self, name: str, version: int) -> None:
        doc = {"adapter": name, "version": version, "time": time.time()}
        await self.transport.put(POLICY_KEY, json.dumps(doc).encode())

    async def read_policy(self) -> tuple[str, int]:
        """The current policy; :class:`~asyncgrpo.errors.NotFound` before the first sync,
        :class:`IntegrityError` naming it if malformed."""
        where = f"{self.transport.url}/{POLICY_KEY}"
        return _policy(await read_document(self.transport, POLICY_KEY), where)

    async def wait_for_policy(self, poll_interval_s: float) -> tuple[str, int]:
        """The current policy, once the trainer has written one. A malformed one is logged
        (once per distinct fault) and waited past: the trainer rewrites it at every sync."""
        seen = ""

        async def policy() -> tuple[str, int] | None:
            nonlocal seen
            try:
                return await self.read_policy()
            except NotFound:
                return None
            except IntegrityError as exc:
                seen = warn_once(seen, exc)
                return None

        found = await poll_until(policy, every=poll_interval_s)
        assert found is not None  # no deadline: only an answer ends the wait
        return found

    async def finish(self, step: int, version: int) -> None:
        await self.transport.put(DONE_KEY, json.dumps({"step": step, "version": version}).encode())

    async def finished(self) -> bool:
        return await self.transport.exists(DONE_KEY)


def warn_once(seen: str, exc: IntegrityError) -> str:
    """Log ``exc`` unless it is ``seen`` (the last one logged); the one now seen."""
    if str(exc) != seen:
        log.warning("%s; waiting for the trainer to write a valid one", exc)
    return str(exc)

"""A run's own documents in its transport, written and read here only.

Beside the adapter versions (:class:`~asyncgrpo.store.adapters.AdapterStore`), the checkpoints
(:class:`~asyncgrpo.store.checkpoints.CheckpointStore`) and the rollout channel, a run keeps::

    run.json      {"run_name", "run_id", "created"}  written once, create-only: the run's id, so
                  a restarted run keeps its adapter names and continues their numbering
    policy.json   {"adapter", "version", "time"}     rewritten by the trainer after each sync:
                  the version split rollout processes generate under
    done.json     {"step", "version"}                written by the trainer when it finishes:
                  the split rollout processes stop
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound
from asyncgrpo.transport import Transport, open_transport

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


def parse_policy(data: bytes) -> tuple[str, int]:
    """(adapter name, version) from a ``policy.json``."""
    doc: dict[str, Any] = json.loads(data)
    return str(doc["adapter"]), int(doc["version"])


class RunStore:
    """The run's documents (``run.json``, ``policy.json``, ``done.json``) in ``transport``."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def existing_run_id(self, run_name: str) -> str:
        """The id of a run that has started here; :class:`ConfigError` when none has (or
        another run owns this transport)."""
        try:
            stored = json.loads(await self.transport.get(RUN_KEY))
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
        return str(stored["run_id"])

    async def run_id(self, run_name: str) -> str:
        """The run's id, created once (create-only write: two racing starts agree on one id)."""
        doc = {"run_name": run_name, "run_id": secrets.token_hex(4), "created": time.time()}
        try:
            await self.transport.put(RUN_KEY, json.dumps(doc).encode(), mode="create")
        except AlreadyExists:
            pass
        stored = json.loads(await self.transport.get(RUN_KEY))
        if stored["run_name"] != run_name:
            raise ConfigError(
                f"transport {self.transport.url} holds run {stored['run_name']!r}, not "
                f"{run_name!r}: give each run its own transport_url (or prefix)"
            )
        return str(stored["run_id"])

    async def write_policy(self, name: str, version: int) -> None:
        doc = {"adapter": name, "version": version, "time": time.time()}
        await self.transport.put(POLICY_KEY, json.dumps(doc).encode())

    async def read_policy(self) -> tuple[str, int]:
        """The current policy; :class:`~asyncgrpo.errors.NotFound` before the first sync."""
        return parse_policy(await self.transport.get(POLICY_KEY))

    async def wait_for_policy(self, poll_interval_s: float) -> tuple[str, int]:
        """The current policy, once the trainer has written one."""
        while True:
            try:
                return await self.read_policy()
            except NotFound:
                await anyio.sleep(poll_interval_s)

    async def finish(self, step: int, version: int) -> None:
        await self.transport.put(DONE_KEY, json.dumps({"step": step, "version": version}).encode())

    async def finished(self) -> bool:
        return await self.transport.exists(DONE_KEY)

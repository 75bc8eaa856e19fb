"""Start vLLM replicas as subprocesses and make sure none outlives its owner.

Each replica runs in its own session (process group), so the API server, its engine-core
process and any workers are stopped together (:func:`asyncgrpo.processes.stop_group`, in a
shielded scope so cancellation and Ctrl-C still clean up); if this process is killed outright,
the API server gets SIGTERM and stops its engine core (:func:`~asyncgrpo.processes.start_group`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
from anyio.abc import Process

from asyncgrpo.config.model_source import check_model
from asyncgrpo.config.serve import ServeConfig, is_loopback
from asyncgrpo.errors import ReplicaError, ReplicaStartError
from asyncgrpo.processes import (
    free_port,
    kill_tree,
    log_tail,
    process_tree,
    start_group,
    stop_group,
)
from asyncgrpo.serve.memory import with_kv_cache_size
from asyncgrpo.serve.vllm_support import check_plugin_support
from asyncgrpo.vllm.client import VLLMClient
from asyncgrpo.vllm.health import wait_healthy

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
STOP_GRACE_S = 15.0
#: A file each replica start is appended to (a JSON line when spawned, one when healthy), from
#: whichever process starts it: a test suite or benchmark counts the vLLM starts it caused,
#: its subprocesses' included (they inherit the variable).
JOURNAL_ENV = "ASYNCGRPO_REPLICA_JOURNAL"


@dataclass(eq=False)
class Replica:
    """One running vLLM server."""

    index: int
    host: str
    port: int
    log_path: Path
    process: Process = field(repr=False)
    started_s: float = 0.0  #: seconds from spawn to healthy

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def send_signal(self, sig: int) -> None:
        """Signal the API server process only (e.g. SIGTERM to make vLLM drain)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def descendants(self) -> list[int]:
        """PIDs of the API server and every process below it."""
        return process_tree(self.pid)

    def kill(self) -> None:
        """SIGKILL the whole process tree at once (simulates a crashed host)."""
        kill_tree(self.pid)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines) or "(no log)"

    def failure(self, what: str) -> ReplicaStartError:
        """A start failure quoting vLLM's root cause (else the log tail) and naming the log."""
        try:
            causes = root_causes(self.log_path.read_text(errors="replace"))
        except OSError:
            causes = []
        where = f"vLLM replica {self.index} (port {self.port}) {what}"
        if causes:  # one line: the cause is what a user acts on
            return ReplicaStartError(
                f"{where}; root cause: {'; '.join(causes)}; full log: {self.log_path}"
            )
        return ReplicaStartError(
            f"{where}; full log: {self.log_path}, last lines:\n{self.log_tail()}"
        )


#: vLLM prefixes each line of a child process with ``(EngineCore_DP0 pid=123)``.
_PROCESS_TAG = re.compile(r"^\((?P<tag>[^()]*?pid=\d+)\)\s*")
#: A log record below ERROR (a warning may mention an error it merely guards against).
_QUIET = re.compile(r"(?:DEBUG|INFO|WARNING) \d\d-\d\d ")
#: A later process's error that contains this many leading characters of an earlier one's
#: message passes that error on (vLLM's engine core: "Worker failed with error '...'").
_QUOTED_CHARS = 20
_ERROR = re.compile(r"(?<![\w.])(?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S.*")


def root_causes(log: str) -> list[str]:
    """The first ``...Error: message`` line of every process in a replica's log.

    A replica is several processes (API server, engine core, workers) writing one log; the API
    server's own last words are only "Engine core initialization failed. See root cause above",
    so the cause is the first error each process printed, not the tail. Indented lines right
    after it (a multi-line message, e.g. pydantic's) are joined to it. A process that only passes
    an earlier one's error on (its message quotes that message's start, or says "see root cause
    above") is left out when an earlier cause remains.
    """
    first: dict[str, str] = {}
    following = None  # the process whose error line came last, while its message continues
    for line in log.splitlines():
        tag = _PROCESS_TAG.match(line)
        process = tag["tag"] if tag else ""
        rest = line[tag.end() :] if tag else line
        if process == following and rest[:1].isspace() and rest.strip():
            first[process] += " " + rest.strip()
            continue
        following = None
        if process in first or _QUIET.match(rest):
            continue
        if (error := _ERROR.search(rest)) and error[0] not in first.values():
            first[process], following = error[0], process
    causes: list[tuple[str, str]] = []
    for process, error in first.items():
        message = error.split(": ", 1)[-1]
        passed_on = "root cause above" in message.lower() or any(
            earlier.split(": ", 1)[-1][:_QUOTED_CHARS] in message for _, earlier in causes
        )
        if not (passed_on and causes):
            causes.append((process, error))
    return [f"({p}) {e}" if p else e for p, e in causes]


async def _wait_healthy(replica: Replica, timeout_s: float, api_key: str | None) -> None:
    async def url() -> str:
        if replica.process.returncode is not None:
            raise replica.failure(
                f"exited with code {replica.process.returncode} before becoming healthy"
            )
        return replica.url

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if not await wait_healthy(
        url, timeout_s=timeout_s, interval_s=0.5, headers=headers, request_timeout_s=2
    ):
        raise replica.failure(
            f"not healthy after {timeout_s:.0f} s (raise serve.startup_timeout_s if the host is "
            "slow)"
        )


async def dev_routes_open(url: str) -> bool:
    """Whether the vLLM server at ``url`` answers a development route (``/server_info``)
    without a key. vLLM's ``--api-key`` guards only ``/v1``-style paths; asyncgrpo's plugin
    guards the rest, so True means it did not load. ReplicaError if it cannot be asked."""
    async with VLLMClient(url, timeout_s=10) as client:
        return await client.dev_routes_open()


async def _refuse_open_routes(replica: Replica, host: str) -> None:
    """A replica other machines can reach must not answer development routes without the key."""
    try:
        is_open = await dev_routes_open(replica.url)
    except ReplicaError as exc:  # the transport's words: the failure names the replica
        why = exc.__cause__ or exc
        raise replica.failure(f"could not be checked for open development routes ({why})") from exc
    if is_open:
        raise replica.failure(
            f"binds {host} but answers /server_info without the API key, so /collective_rpc, "
            "/pause and the other development routes are open to anyone who reaches it: "
            "asyncgrpo's vLLM plugin did not load (check VLLM_PLUGINS=asyncgrpo and that this "
            "vLLM supports endpoint plugins)"
        )


def _log_paths(config: ServeConfig) -> list[Path]:
    """Log files that outlive the replicas: a failed start is read after everything stopped."""
    if config.log_dir:
        log_dir = Path(config.log_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_dir = Path.home() / ".cache" / "asyncgrpo" / "replica-logs" / f"{stamp}-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    return [log_dir / f"replica-{i}.log" for i in range(config.replicas)]


def _journal(event: str, replica: Replica, **fields: object) -> None:
    """Append ``event`` for ``replica`` to the file :data:`JOURNAL_ENV` names, if any."""
    if not (path := os.environ.get(JOURNAL_ENV)):
        return
    line = json.dumps({"event": event, "pid": replica.pid, "port": replica.port, **fields})
    try:
        with open(path, "a") as journal:  # one short write: appends from processes don't mix
            journal.write(line + "\n")
    except OSError as exc:
        logger.warning("cannot append to %s=%s: %s", JOURNAL_ENV, path, exc)


def _lower_session_priority(pid: int, nice: int) -> None:
    """Give the replica's session (its own, :func:`start_group`) the nice value too.

    With Linux's scheduler autogroups (on by default on desktops and many VMs) CPU is shared
    between sessions first, so a process's own nice value only ranks it inside its session:
    without this, two spinning replicas get two thirds of the CPU whatever their nice value.
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        pass  # no autogroups (kernel option off, or not Linux): the process nice value applies


@contextlib.asynccontextmanager
async def launch_replicas(config: ServeConfig) -> AsyncIterator[list[Replica]]:
    """Start ``config.replicas`` vLLM servers, wait until all are healthy, stop all on exit.

    Raises :class:`ReplicaStartError` quoting vLLM's root cause if any replica exits or misses
    ``startup_timeout_s``; the others are stopped before it propagates. On a CPU host without
    ``kv_cache_gib`` the KV cache is sized first (:mod:`asyncgrpo.serve.memory`).
    """
    await anyio.to_thread.run_sync(check_model, config.model)
    if config.transports:  # replicas that fetch adapters need the plugin's vLLM internals
        check_plugin_support()
    config = with_kv_cache_size(config)
    replicas: list[Replica] = []
    try:
        for i, log_path in enumerate(_log_paths(config)):
            port = config.port + i if config.port is not None else free_port(config.host)
            with log_path.open("ab") as log:
                argv = config.command(port)
                if config.nice:  # inherited by the engine and worker processes vLLM forks
                    argv = ["nice", "-n", str(config.nice), *argv]
                process = await start_group(argv, stdout=log, stderr=log, env=config.env(i))
            if config.nice:
                _lower_session_priority(process.pid, config.nice)
            replicas.append(Replica(i, config.host, port, log_path, process, time.monotonic()))
            _journal("spawn", replicas[-1], model=config.model)
            logger.info("replica %d starting on port %d (log %s)", i, port, log_path)

        failures: list[ReplicaStartError] = []

        async def wait(replica: Replica, tg: anyio.abc.TaskGroup) -> None:
            spawned = replica.started_s
            try:
                await _wait_healthy(replica, config.startup_timeout_s, config.api_key)
                if not is_loopback(config.host):
                    await _refuse_open_routes(replica, config.host)
            except ReplicaStartError as exc:
                failures.append(exc)
                tg.cancel_scope.cancel()  # fail fast: no point waiting for the others
                return
            replica.started_s = time.monotonic() - spawned
            _journal("healthy", replica, seconds=round(replica.started_s, 2))
            logger.info(
                "replica %d healthy at %s after %.1f s",
                replica.index,
                replica.url,
                replica.started_s,
            )

        async with anyio.create_task_group() as tg:
            for replica in replicas:
                tg.start_soon(wait, replica, tg)
        if failures:
            raise failures[0]
        yield replicas
    finally:
        with anyio.CancelScope(shield=True):
            if replicas:
                logger.info("stopping %d replica(s)", len(replicas))
            async with anyio.create_task_group() as tg:
                for replica in replicas:
                    tg.start_soon(
                        stop_group, replica.process, STOP_GRACE_S, f"replica {replica.index}"
                    )
            for replica in replicas:
                await replica.process.aclose()

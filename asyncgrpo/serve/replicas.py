"""Start vLLM replicas as subprocesses and make sure none outlives its owner.

Each replica runs in its own session (process group), so the API server, its engine-core
process and any workers can be signalled together. Shutdown sends SIGTERM to the group, waits,
then SIGKILLs whatever is left, including descendants that moved to another group; it runs in
a shielded scope so cancellation and Ctrl-C still clean up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
import anyio.abc
from anyio.abc import Process

from asyncgrpo.errors import ReplicaStartError
from asyncgrpo.serve.config import ServeConfig, is_loopback
from asyncgrpo.serve.memory import with_kv_cache_size

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
STOP_GRACE_S = 15.0


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
        return _process_tree(self.pid)

    def kill(self) -> None:
        """SIGKILL the whole process tree at once (simulates a crashed host)."""
        pids = self.descendants()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> ReplicaStartError:
        """A start failure quoting vLLM's root cause (else the log tail) and naming the log."""
        try:
            causes = root_causes(self.log_path.read_text(errors="replace"))
        except OSError:
            causes = []
        detail = "\n".join(f"  {c}" for c in causes) or self.log_tail()
        kind = "root cause" if causes else "last lines"
        return ReplicaStartError(
            f"vLLM replica {self.index} (port {self.port}) {what}; {kind}:\n{detail}\n"
            f"full log: {self.log_path}"
        )


#: vLLM prefixes each line of a child process with ``(EngineCore_DP0 pid=123)``.
_PROCESS_TAG = re.compile(r"^\((?P<tag>[^()]*?pid=\d+)\)\s*")
#: A log record below ERROR (a warning may mention an error it merely guards against).
_QUIET = re.compile(r"(?:DEBUG|INFO|WARNING) \d\d-\d\d ")
_ERROR = re.compile(r"(?<![\w.])(?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S.*")


def root_causes(log: str) -> list[str]:
    """The first ``...Error: message`` line of every process in a replica's log.

    A replica is several processes (API server, engine core, workers) writing one log; the API
    server's own last words are only "Engine core initialization failed. See root cause above",
    so the cause is the first error each process printed, not the tail. Indented lines right
    after it (a multi-line message, e.g. pydantic's) are joined to it; a message already quoted
    (a re-raise in another process) is not repeated.
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
    return [f"({p}) {e}" if p else e for p, e in first.items()]


def _process_tree(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:  # vLLM depends on psutil; without it the process group covers most cases
        return [pid]
    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _wait_healthy(replica: Replica, timeout_s: float, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(headers=headers) as session:
        while True:
            if replica.process.returncode is not None:
                raise replica.failure(
                    f"exited with code {replica.process.returncode} before becoming healthy"
                )
            if time.monotonic() > deadline:
                raise replica.failure(
                    f"not healthy after {timeout_s:.0f} s (raise serve.startup_timeout_s if the "
                    "host is slow)"
                )
            try:
                async with session.get(
                    f"{replica.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await anyio.sleep(0.5)


async def dev_routes_open(url: str) -> bool:
    """Whether the vLLM server at ``url`` answers a development route (``/server_info``)
    without a key. vLLM's ``--api-key`` guards only ``/v1``-style paths; asyncgrpo's plugin
    guards the rest, so True means it did not load."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/server_info", timeout=aiohttp.ClientTimeout(total=10)) as resp,
    ):
        return resp.status != 401


async def _refuse_open_routes(replica: Replica, host: str) -> None:
    """A replica other machines can reach must not answer development routes without the key."""
    try:
        is_open = await dev_routes_open(replica.url)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise replica.failure(f"could not be checked for open development routes ({exc})") from exc
    if is_open:
        raise replica.failure(
            f"binds {host} but answers /server_info without the API key, so /collective_rpc, "
            "/pause and the other development routes are open to anyone who reaches it: "
            "asyncgrpo's vLLM plugin did not load (check VLLM_PLUGINS=asyncgrpo and that this "
            "vLLM supports endpoint plugins)"
        )


def _alive(pids: list[int]) -> list[int]:
    try:
        import psutil
    except ImportError:
        return []
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


async def _wait_gone(replica: Replica, pids: list[int], timeout_s: float) -> bool:
    with anyio.move_on_after(timeout_s):
        await replica.process.wait()
        # The engine core may outlive the API server by a moment; nothing to await but its exit.
        while _alive(pids):  # noqa: ASYNC110
            await anyio.sleep(0.1)
        return True
    return False


async def _stop(replica: Replica) -> None:
    pids = replica.descendants()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(replica.pid, signal.SIGTERM)
    if await _wait_gone(replica, pids, STOP_GRACE_S):
        return
    logger.warning("replica %d ignored SIGTERM for %.0f s; killing it", replica.index, STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(replica.pid, signal.SIGKILL)
    for pid in _alive(pids):  # descendants that left the group
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await _wait_gone(replica, pids, 10)


def _log_paths(config: ServeConfig) -> list[Path]:
    """Log files that outlive the replicas: a failed start is read after everything stopped."""
    if config.log_dir:
        log_dir = Path(config.log_dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        log_dir = Path.home() / ".cache" / "asyncgrpo" / "replica-logs" / f"{stamp}-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    return [log_dir / f"replica-{i}.log" for i in range(config.replicas)]


def _lower_session_priority(pid: int, nice: int) -> None:
    """Give the replica's session (its own, ``start_new_session``) the nice value too.

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
    config = with_kv_cache_size(config)
    replicas: list[Replica] = []
    try:
        for i, log_path in enumerate(_log_paths(config)):
            port = config.port + i if config.port is not None else free_port(config.host)
            with log_path.open("ab") as log:
                argv = config.command(port)
                if config.nice:  # inherited by the engine and worker processes vLLM forks
                    argv = ["nice", "-n", str(config.nice), *argv]
                process = await anyio.open_process(
                    argv,
                    stdin=None,
                    stdout=log,
                    stderr=log,
                    env=config.env(i),
                    start_new_session=True,
                )
            if config.nice:
                _lower_session_priority(process.pid, config.nice)
            replicas.append(Replica(i, config.host, port, log_path, process, time.monotonic()))
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
            async with anyio.create_task_group() as tg:
                for replica in replicas:
                    tg.start_soon(_stop, replica)
            for replica in replicas:
                await replica.process.aclose()

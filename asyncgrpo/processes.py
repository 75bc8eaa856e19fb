"""Child process trees this process starts (vLLM replicas, a launch's roles): stop them whole.

:func:`start_group` is the one way they are started: in a session of its own, so the child and
everything it forks share one process group that can be signalled at once, and (on Linux) with
SIGTERM as its parent-death signal, so a child still gets its clean shutdown when this process
dies without stopping it (SIGKILL, the OOM killer); that shutdown stops its own descendants (vLLM's
API server stops its engine core). A child that ignores that SIGTERM (vLLM's API server does while
its engine starts) is SIGKILLed a grace later by a watchdog (:mod:`asyncgrpo.parent_death`).
:func:`stop_group` is the one way they are stopped: SIGTERM to the group, a grace period for the
process and every descendant to exit, then SIGKILL to the group and to the descendants that left
it. Callers run it in a shielded scope, so cancellation and Ctrl-C still clean up.

Elsewhere than Linux there is no parent-death signal: a child outlives a parent killed outright.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio
from anyio.abc import Process

from asyncgrpo.parent_death import WATCHDOG_NAME
from asyncgrpo.retry import poll_until

logger = logging.getLogger(__name__)

#: The program put in front of a child's command (:mod:`asyncgrpo.parent_death`).
_PARENT_DEATH = str(Path(__file__).with_name("parent_death.py"))
#: How long an orphaned child has between its SIGTERM and SIGKILL: a serve process's own
#: shutdown (its vLLM servers' grace, then their SIGKILL) fits in it.
ORPHAN_GRACE_S = 30.0
#: The process name of the idle watchdog beside each child (``ps -o comm``, psutil's ``name()``).
WATCHDOG = WATCHDOG_NAME.decode()


def parent_death_argv(
    argv: Sequence[str], env: Mapping[str, str] | None = None, *, grace_s: float = ORPHAN_GRACE_S
) -> list[str]:
    """``argv`` run so that the program gets SIGTERM when the thread that starts it ends, however,
    and SIGKILL ``grace_s`` after this process exits if it is still there.

    The kernel ties the signal to that thread, not to its process: start children from a thread
    that lives as long as they should (the event loop's, as :func:`start_group` does), never from
    a worker thread (``to_thread``, ``run_in_executor``). On Linux only; elsewhere ``argv``
    unchanged. The program is looked up on ``env``'s PATH now, so a missing one raises
    :class:`FileNotFoundError` here as with ``subprocess``.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    program = argv[0]
    path = (
        program
        if os.sep in program
        else shutil.which(program, path=os.pathsep.join(os.get_exec_path(env)))
    )
    if path is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    return [sys.executable, "-I", "-S", _PARENT_DEATH, str(os.getpid()), str(grace_s), path, *argv]


async def start_group(
    argv: Sequence[str],
    *,
    stdout: int | IO[Any] | None,
    stderr: int | IO[Any] | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | IO[Any] | None = None,
) -> Process:
    """Start ``argv`` in a session of its own that gets SIGTERM if this process dies first."""
    return await anyio.open_process(
        parent_death_argv(argv, env),
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (``[]`` once it is gone)."""
    try:
        import psutil
    except ImportError:  # vLLM depends on psutil; without it the process group covers most cases
        return [pid]
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (zombies count as gone)."""
    try:
        import psutil
    except ImportError:
        return []
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def _signal_tree(leader: int, pids: list[int], sig: int) -> None:
    """``sig`` to ``leader``'s process group and to each of ``pids`` (those that left it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s group and every descendant at once (a crashed host, in tests)."""
    _signal_tree(pid, process_tree(pid), signal.SIGKILL)


async def stop_group(process: Process, grace_s: float, what: str) -> None:
    """SIGTERM ``process``'s group; after ``grace_s`` SIGKILL whatever of its tree is left."""
    pids = process_tree(process.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    if await _gone(process, pids, grace_s):
        return
    logger.warning("%s ignored SIGTERM for %.0f s; killing it", what, grace_s)
    _signal_tree(process.pid, alive(pids), signal.SIGKILL)
    await _gone(process, pids, 10)


async def _gone(process: Process, pids: list[int], timeout_s: float) -> bool:
    async def all_gone() -> bool | None:
        return None if alive(pids) else True

    with anyio.move_on_after(timeout_s):
        await process.wait()
        # A child (vLLM's engine core) may outlive the leader by a moment; nothing to await.
        await poll_until(all_gone, every=0.1)
        return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a child to bind later.

    Chosen below the kernel's ephemeral range where there is room: a port in that range can be
    handed to any socket on the host (a bind to port 0, every outgoing connection, vLLM's own
    sockets) in the seconds before the child binds it, and the child then fails with "address
    already in use". Nor in the range Ray's workers bind by default (10002-19999), which
    ``ray start --port`` refuses. Ports this process handed out before are not given again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    room = range(max(1024, low - 16384, RAY_WORKER_PORTS.stop), low)
    if len(room) >= 4096:
        for port in _RANDOM.sample(room, 64):
            if port in _handed_out:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


#: Ray's default worker ports (``--min-worker-port``, ``--max-worker-port``).
RAY_WORKER_PORTS = range(10002, 20000)
_handed_out: set[int] = set()
# Its own source: a caller that seeded ``random`` neither shifts nor repeats the ports.
_RANDOM = random.SystemRandom()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a process's log file; empty when it has none or is missing
    (a failure message then says so rather than raising over a log that never came)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])

"""Child process trees this process starts (vLLM replicas, a launch's roles): stop them whole.

Each child is started in its own session (``start_new_session=True``), so it and everything it
forks share one process group that can be signalled at once. :func:`stop_group` is the one way
they are stopped: SIGTERM to the group, a grace period for the process and every descendant to
exit, then SIGKILL to the group and to the descendants that left it. Callers run it in a
shielded scope, so cancellation and Ctrl-C still clean up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket

import anyio
from anyio.abc import Process

logger = logging.getLogger(__name__)


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
    with anyio.move_on_after(timeout_s):
        await process.wait()
        # A child (vLLM's engine core) may outlive the leader by a moment; nothing to await.
        while alive(pids):  # noqa: ASYNC110
            await anyio.sleep(0.1)
        return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a child to bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

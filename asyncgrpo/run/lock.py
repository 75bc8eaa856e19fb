"""One owner per run directory: a lock a command takes before it starts anything there.

Two ``asyncgrpo train`` (or ``launch``) commands in one run directory would publish the same
version names, overwrite each other's replica logs and metrics, and fail a minute later in
ways that do not say why. The first takes ``<run_dir>/run.lock`` (an exclusive ``flock``,
which the kernel releases when its process ends, however it ends: no stale lock to delete) and
writes its PID, host and start time in it; the second is refused at once, naming them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from asyncgrpo.config.paths import writable_dir
from asyncgrpo.errors import ConfigError

__all__ = ["LOCK_FILE", "run_dir_lock"]

LOCK_FILE = "run.lock"


def _holder(path: Path) -> str:
    try:
        doc = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["started"])))
        return f"{doc['command']} (PID {doc['pid']} on host {doc['host']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its PID yet)"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, command: str, *, setting: str = "output_dir") -> Iterator[Path]:
    """Hold ``run_dir``'s lock (creating the directory) while the block runs; refuse with a
    :class:`ConfigError` naming the holder when another process holds it. ``command`` is what
    a refused one is told holds it (``asyncgrpo train``)."""
    run_dir = writable_dir(Path(run_dir), setting)
    path = run_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"run directory {run_dir} is in use by {_holder(path)}: wait for it to end or "
                "stop it, or give this run another run_name or output_dir"
            ) from None
        # the holder before us may have removed the file after we opened it: lock the new one
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        doc = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command,
            "started": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(doc) + "\n").encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # while still holding it: the next owner makes a fresh one
        os.close(fd)

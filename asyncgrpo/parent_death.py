"""Run a program so that it does not outlive the process that started it (Linux).

``python -I -S parent_death.py PARENT_PID GRACE_S PATH ARGV0 [ARG...]`` is what
:func:`asyncgrpo.processes.parent_death_argv` puts in front of a long-lived child's command. It

- sets the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): the program gets SIGTERM,
  its clean shutdown, when the thread that started it ends, however;
- forks a watchdog: when the process that started it (``PARENT_PID``) has exited and the program
  still runs ``GRACE_S`` later, the watchdog SIGKILLs the program's process group and then the
  program. A program may ignore SIGTERM (vLLM's API server does while its engine starts), and
  the process that would have escalated is gone;
- exits if its parent is no longer ``PARENT_PID`` (the parent died before the signal was set, so
  none will come), and replaces itself with ``PATH`` (same pid; the setting survives ``execve``
  except into set-user-ID, set-group-ID or file-capability programs).

The watchdog is the program's child, in a process group of its own (a stop signal to the
program's group does not reach it) with SIGKILL as its own parent-death signal, so it ends with
the program; it waits on a pidfd of ``PARENT_PID``, opened before the parent check (so it cannot
name a recycled pid). A program rather than ``preexec_fn``: anyio's ``open_process`` takes none,
and ``preexec_fn`` is unsafe in a process with threads and makes ``subprocess`` fork instead of
vfork.

Standard library only, run without ``site``: it must not import asyncgrpo or its dependencies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15
#: The watchdog's process name (``ps -o comm``, psutil's ``name()``): idle, and not niced.
WATCHDOG_NAME = b"asyncgrpo-watch"


def _set_parent_death_signal(libc: ctypes.CDLL, sig: int) -> None:
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        sys.exit(f"asyncgrpo: prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")


def _watch(
    libc: ctypes.CDLL, program: int, parent: int, pidfd: int, grace_s: float, path: str
) -> None:
    """The watchdog: wait for ``parent`` to exit, give the program ``grace_s``, then SIGKILL it.

    ``program`` is the pid the fork came from, taken before the fork: read here with
    ``getppid()``, it would be the reaper's pid if the program had already ended, and the
    watchdog would then outlive it, holding its stderr open.
    """
    try:
        os.setpgid(0, 0)
        _set_parent_death_signal(libc, signal.SIGKILL)  # the program gone: nothing to watch
        if os.getppid() != program:  # it ended before the signal was set
            os._exit(0)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(WATCHDOG_NAME), 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)  # hold none of the program's pipes but stderr
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        select.select([pidfd], [], [])  # readable once the parent has exited
        time.sleep(grace_s)
        sys.stderr.write(
            f"asyncgrpo: {path} (pid {program}) still runs {grace_s:g} s after the process that "
            f"started it (pid {parent}) exited: killing it\n"
        )
        sys.stderr.flush()
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(program, signal.SIGKILL)
    except BaseException:  # whatever happens, a watchdog never goes on as a copy of the program
        pass
    os._exit(0)


def main(args: Sequence[str]) -> None:
    parent, grace, path, *argv = args
    libc = ctypes.CDLL(None, use_errno=True)
    _set_parent_death_signal(libc, signal.SIGTERM)
    try:
        pidfd = os.pidfd_open(int(parent))
    except OSError:  # no pidfds (Linux < 5.3), or the parent is gone (checked next)
        pidfd = -1
    if os.getppid() != int(parent):
        sys.exit(
            f"asyncgrpo: not starting {path}: the process that started it (pid {parent}) has exited"
        )
    if pidfd >= 0:
        program = os.getpid()
        if os.fork() == 0:
            _watch(libc, program, int(parent), pidfd, float(grace), path)
        os.close(pidfd)
    # The interpreter ignores these and an ignored signal stays ignored across exec; subprocess
    # gives a program the defaults (restore_signals), so this does too.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execv(path, argv)
    except OSError as exc:
        sys.exit(f"asyncgrpo: cannot run {path}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])

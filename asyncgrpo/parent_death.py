"""Run a program so that it gets SIGTERM when the thread that started it ends (Linux).

``python -I -S parent_death.py PARENT_PID PATH ARGV0 [ARG...]`` is what
:func:`asyncgrpo.processes.parent_death_argv` puts in front of a long-lived child's command: it
sets the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGTERM)``), exits if its parent is no
longer ``PARENT_PID`` (the parent died before the signal was set, so none will come), and
replaces itself with ``PATH`` (same pid; the setting survives ``execve`` except into set-user-ID,
set-group-ID or file-capability programs). A program rather than ``preexec_fn``: anyio's
``open_process`` takes none, and ``preexec_fn`` is unsafe in a process with threads and makes
``subprocess`` fork instead of vfork.

Standard library only, run without ``site``: it must not import asyncgrpo or its dependencies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def main(args: Sequence[str]) -> None:
    parent, path, *argv = args
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        sys.exit(f"asyncgrpo: prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):
        sys.exit(f"asyncgrpo: not starting {path}: the process that started it (pid {parent}) "
                 "has exited")  # fmt: skip
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

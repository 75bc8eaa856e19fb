"""How every asyncgrpo command runs and ends: one line per error, and a documented exit status.

Exit statuses (``asyncgrpo ...``, ``python -m asyncgrpo.serve``, the launched trainer job, and the
settings of ``python -m asyncgrpo.proxy``; docs/config.md, "Exit statuses"):

- 0: done;
- 1: the run failed: a replica did not start, a sync did not reach every replica, storage
  failed, a launched job died, or an error asyncgrpo did not expect (its type is named);
- 2: a setting, an argument or the model must change first (:class:`ConfigError`, argparse's own
  errors); nothing was started, or what was is stopped;
- 130: interrupted (Ctrl-C or SIGTERM); whatever the command started is stopped first.

An error raised inside a task group arrives wrapped in exception groups: each leaf is reported on
its own line (the cancellations that only follow another task's error are left out). The cause
comes first on each line; a launched job's failure adds its log tail below. ``--debug`` (or
``ASYNCGRPO_DEBUG=1``) prints the full traceback first, for developers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

from asyncgrpo.errors import (
    DEBUG_ENV,
    AsyncGRPOError,
    ConfigError,
    UsageError,
    leaves,
    redact_text,
)
from asyncgrpo.errors import DEBUG_HELP as DEBUG_HELP  # where the commands imported it from

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain_help(doc: str | None) -> str | None:
    """A docstring as ``--help`` text: reST markup gone (double backticks, ``:mod:`a.b```
    roles), so the terminal shows what a user types, not how the docs render it."""
    if doc is None:
        return None
    return _ROLE.sub(lambda m: m.group(1), doc).replace("``", "")


def debug_requested(flag: bool = False) -> bool:
    """``--debug`` given, or ``ASYNCGRPO_DEBUG`` set to a true value."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _reported(exc: BaseException) -> list[BaseException]:
    """The leaves worth a line: cancellations only follow another error, unless alone."""
    found = leaves(exc)
    return [e for e in found if not isinstance(e, asyncio.CancelledError)] or found


def exit_status(exc: BaseException) -> int:
    """The documented status for ``exc`` (see the module docstring)."""
    found = _reported(exc)
    if any(isinstance(e, KeyboardInterrupt) for e in found):
        return EXIT_INTERRUPTED
    exits = [e for e in found if isinstance(e, SystemExit)]
    if exits:
        code = exits[0].code
        return code if isinstance(code, int) else EXIT_FAILED
    if all(isinstance(e, ConfigError) for e in found):
        return EXIT_USAGE
    return EXIT_FAILED


def _message(exc: BaseException) -> str | None:
    if isinstance(exc, KeyboardInterrupt):
        return None
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, str) else None
    if isinstance(exc, ConfigError):  # a setting: always one line
        return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if isinstance(exc, AsyncGRPOError):
        return str(exc)
    text = str(exc) or "(no message)"
    return f"{type(exc).__name__}: {text} (unexpected; rerun with --debug or {DEBUG_ENV}=1 for the traceback)"


def error_lines(prog: str, exc: BaseException) -> list[str]:
    """``prog: error: <cause>`` for each leaf of ``exc`` (none for an interruption), with the
    credentials of every URL in it redacted (:func:`~asyncgrpo.errors.redact_text`: a message
    may quote a transport URL with its SAS token, from asyncgrpo or a library)."""
    return [
        redact_text(f"{prog}: error: {m}") for e in _reported(exc) if (m := _message(e)) is not None
    ]


def report(prog: str, exc: BaseException, *, debug: bool = False) -> int:
    """Print ``exc`` as its error lines (its traceback first when debugging); its status."""
    if debug_requested(debug) and exc.__traceback__ is not None:
        traceback.print_exception(exc, file=sys.stderr)
    for line in error_lines(prog, exc):
        print(line, file=sys.stderr)
    return exit_status(exc)


def fail(prog: str, exc: BaseException, *, debug: bool = False) -> NoReturn:
    """Report an error found before anything started (parsing, settings) and exit with its
    status (``SystemExit``: callers and tests may catch it)."""
    sys.exit(report(prog, exc, debug=debug))


def parse_command_line(parse: Callable[[], T], prog: str) -> T:
    """``parse()``: a command's parsing and settings; a :class:`ConfigError` it raises (a bad
    argument, flag, variable or file) is reported as one line and the process exits with status
    2 (:func:`fail`), named by the (sub)command whose parser found it (a :class:`UsageError`'s
    ``prog``). The config layer only raises: deciding to exit is the command's."""
    try:
        return parse()
    except UsageError as exc:
        if exc.debug is None:  # argparse's own refusal: its message is all there is
            fail(exc.prog, exc.with_traceback(None))
        fail(exc.prog, exc, debug=exc.debug)
    except ConfigError as exc:
        fail(prog, exc)


def run_command(body: Callable[[], object], prog: str, *, debug: bool = False) -> NoReturn:
    """Run a command's body and exit: 0, or its error lines and status (:func:`report`)."""
    try:
        body()
    except BaseException as exc:
        exit_process(report(prog, exc, debug=debug))
    exit_process(EXIT_OK)


#: What the first Ctrl-C says when a command does not say more.
STOPPING = (
    "stopping what this command started (a few seconds; children that do not stop get killed)"
)


def run_async(fn: Callable[..., Awaitable[T]], *args: Any, stopping: str = STOPPING) -> T:
    """Run ``fn(*args)`` under anyio with SIGINT and SIGTERM turned into cancellation, so
    replicas, the proxy and the rollout client shut down cleanly (no orphan vLLM processes);
    an interruption then raises ``KeyboardInterrupt``. The first signal prints ``stopping``
    (what the command does now) on stderr: the user sees their Ctrl-C was heard."""
    import anyio

    interrupted = False
    log = logging.getLogger(__name__)

    async def main() -> T | None:
        nonlocal interrupted
        # Open for the whole run, shutdown included: a second SIGTERM or Ctrl-C while children
        # are being stopped is logged, not fatal (the default action would kill this process
        # mid-shutdown and leave its children running). The shutdown is bounded by its grace.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            work = anyio.CancelScope()

            async def watch() -> None:
                nonlocal interrupted
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if interrupted:
                        print(f"{name} again: still stopping", file=sys.stderr, flush=True)
                        continue
                    log.info("%s received: stopping", name)  # a server's log says what stopped it
                    print(f"\n{name}: {stopping}", file=sys.stderr, flush=True)
                    interrupted = True
                    work.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                with work:
                    result = await fn(*args)
                tg.cancel_scope.cancel()
            return None if interrupted else result

    result = anyio.run(main)
    if interrupted:
        raise KeyboardInterrupt
    return result  # type: ignore[return-value]


def exit_process(code: int) -> NoReturn:
    """Exit with ``code`` without interpreter teardown, once output and logs are flushed.

    obstore's background runtime (the S3, GCS, Azure and HF-bucket transports) can abort the
    process (SIGABRT) while Python finalizes, after all work is done: 5 of 20 runs of a plain
    put/get script against a loopback S3 server here, 2 of 20 with obstore alone. A finished
    run must not report a crash to whoever reads its exit status (a launcher, torchrun, CI).
    Everything that must outlive the process is closed before this point (the run's exit
    stack closes the metrics writer and the transport).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

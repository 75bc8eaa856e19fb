"""Following one job's log to its end: each line to a handler, and into ``job.log_path``.

A backend whose jobs write their own log file (local processes) only reports lines; otherwise
the follower appends what the backend streams to the file, batched by a flusher so a chatty
job costs one write per :data:`FLUSH_S`, not one per line, and nothing is lost at the end.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.lowlevel

from asyncgrpo.launch.jobs import Backend, Job

__all__ = ["FLUSH_S", "LogFollower", "follow_in_thread"]

logger = logging.getLogger(__name__)

#: Seconds between two writes of the lines streamed meanwhile.
FLUSH_S = 0.5


class LogFollower:
    """``await follower.run()`` follows ``job``'s log until the job ends; :attr:`drained` is
    set once every line is handled and written (also when the follow fails or is cancelled)."""

    def __init__(self, backend: Backend, job: Job, on_line: Callable[[str], None]) -> None:
        self.backend = backend
        self.job = job
        self.on_line = on_line
        self.drained = anyio.Event()
        self._pending: list[str] = []

    async def run(self) -> None:
        try:
            if self.backend.writes_own_logs:
                await self.backend.follow_logs(self.job, self.on_line)
            else:
                await self._follow_into_file()
        finally:
            self.drained.set()

    def _take(self, line: str) -> None:
        self._pending.append(line)
        self.on_line(line)

    async def _follow_into_file(self) -> None:
        async with await anyio.open_file(self.job.log_path, "a", encoding="utf-8") as log:
            writing = anyio.Lock()  # the last flush waits for the flusher's: lines in order

            async def flush() -> None:
                async with writing:
                    lines, self._pending = self._pending, []
                    if lines:
                        await log.write("".join(f"{line}\n" for line in lines))
                        await log.flush()

            async def flusher() -> None:
                while True:
                    await anyio.sleep(FLUSH_S)
                    await flush()

            async with anyio.create_task_group() as tg:
                tg.start_soon(flusher)
                try:
                    await self.backend.follow_logs(self.job, self._take)
                finally:
                    with anyio.CancelScope(shield=True):
                        await flush()
                    tg.cancel_scope.cancel()


async def follow_in_thread(
    job: Job, stream: Callable[[Callable[[str], None]], None], on_line: Callable[[str], None]
) -> None:
    """A backend's ``follow_logs`` over a blocking SDK call: ``stream(emit)`` hands each line of
    ``job``'s log to ``emit`` and returns when the log ends; ``on_line`` gets each line on the
    event loop. The call runs in a daemon thread, since the SDKs block inside their HTTP
    clients: on cancellation it is left to end with the job, and never holds up the launcher's
    exit. A stream that fails ends the follow with one warning."""
    token = anyio.lowlevel.current_token()
    ended = anyio.Event()
    errors: list[BaseException] = []

    def emit(line: str) -> None:
        anyio.from_thread.run_sync(on_line, line, token=token)

    def follow() -> None:
        try:
            stream(emit)
        except anyio.RunFinishedError:
            return
        except Exception as exc:
            errors.append(exc)
        with contextlib.suppress(anyio.RunFinishedError, RuntimeError):
            anyio.from_thread.run_sync(ended.set, token=token)

    threading.Thread(target=follow, name=f"logs-{job.name}", daemon=True).start()
    await ended.wait()
    if errors:
        logger.warning("log stream of %s ended: %s", job.name, errors[0])

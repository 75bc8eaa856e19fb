"""What the proxy reads from a generation request's body: decoded, checked, and hashed into its
routing key; small bodies on the event loop, large ones in a worker process.

Why a process, not a thread: decoding a 32 MiB body of millions of one-token prompts, hashing
it and freeing what was decoded take seconds in C calls that hold the GIL, and every other
client of the proxy (in a one-process run, the trainer too) would wait that long. The worker
(a fresh interpreter that imports only this module's few dependencies: a trainer's process
holds CUDA and threads, which a fork would copy half-made) gets the body's bytes and sends
back only what routing needs (:class:`Intake`: a model name, a stream flag, a cost, a bounded
routing key); the proxy forwards the bytes as they came.
Prompt hashes are the same in every process (:mod:`~asyncgrpo.proxy.router`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
import time
from typing import NamedTuple, cast

from asyncgrpo.proxy.http.jsonbody import BodyError, decode_object
from asyncgrpo.proxy.router import request_hashes
from asyncgrpo.proxy.runs import MAX_NAME, sequences

__all__ = ["Intake", "Offload", "read_generation"]

log = logging.getLogger(__name__)


class Intake(NamedTuple):
    """A generation body as the proxy routes it, or why it is refused (``status`` not 0)."""

    status: int
    message: str
    model: str = ""
    stream: bool = False
    cost: int = 1
    chains: tuple[tuple[int, ...], ...] = ()
    hash_s: float = 0.0  #: time the routing key took


def read_generation(body: bytes, max_bytes: int, block_size: int | None) -> Intake:
    """Decode and check a completions or chat body; ``block_size`` None: no routing key (the
    router ignores prefixes). Pure, and picklable both ways: it runs in the worker too."""
    try:
        parsed = decode_object(body, max_bytes)
    except BodyError as exc:
        return Intake(exc.status, str(exc))
    model = parsed.get("model")
    if model is None:
        model = ""
    if not isinstance(model, str) or len(model) > MAX_NAME:
        return Intake(400, f"model must be a string of at most {MAX_NAME} characters")
    chains: list[tuple[int, ...]] = []
    t0 = time.perf_counter()
    if block_size is not None:
        try:
            chains = request_hashes(parsed, block_size)
        except Exception:  # a router bug must not cost the request: route it unmatched
            log.exception("no routing key for a generation request")
    stream, cost = parsed.get("stream") is True, sequences(parsed)
    return Intake(0, "", model, stream, cost, tuple(chains), time.perf_counter() - t0)


#: A body sent to the worker: its size, max_bytes, the block size (-1: no routing key).
_HEAD = struct.Struct("!QQq")
#: The worker's answer: the size of the pickled :class:`Intake` fields that follow.
_ANSWER = struct.Struct("!Q")


class Offload:
    """The worker process that reads large bodies (``python -m asyncgrpo.proxy.intake``),
    started at the first one, one body at a time. The body's pieces are written to its stdin
    as they came, never joined or pickled: each 32 MiB copy would hold the event loop."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._killed: list[asyncio.subprocess.Process] = []  # to reap in :meth:`aclose`
        self._lock = asyncio.Lock()

    async def read(
        self, body: list[bytes | bytearray], max_bytes: int, block_size: int | None
    ) -> Intake:
        async with self._lock:
            try:
                proc = self._proc or await self._start()
                stdin, stdout = cast(asyncio.StreamWriter, proc.stdin), proc.stdout
                size = sum(map(len, body))
                stdin.write(_HEAD.pack(size, max_bytes, -1 if block_size is None else block_size))
                for piece in body:  # drained piece by piece: the loop serves others meanwhile
                    stdin.write(piece)
                    await stdin.drain()
                assert stdout is not None
                (n,) = _ANSWER.unpack(await stdout.readexactly(_ANSWER.size))
                intake = Intake(*pickle.loads(await stdout.readexactly(n)))
            except Exception as exc:  # the worker died (killed, out of memory) or misspoke
                log.warning(
                    "the body reader process failed (%s: %s); restarting it",
                    type(exc).__name__,
                    exc,
                )
                self._kill()
                return Intake(503, "the proxy could not read this request body: retry")
            except BaseException:  # cancelled half-way: the pipe is out of step
                self._kill()
                raise
        return intake

    async def _start(self) -> asyncio.subprocess.Process:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        return self._proc

    def _kill(self) -> None:
        """Stop the worker; the next body starts another."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._killed.append(proc)
            with contextlib.suppress(ProcessLookupError):  # gone already
                proc.kill()

    async def aclose(self) -> None:
        """Stop the worker and reap it (its pipes close with it)."""
        self._kill()
        killed, self._killed = self._killed, []
        for proc in killed:
            await proc.wait()


def _serve() -> None:
    """The worker: read bodies from stdin, answer each with its :class:`Intake`, until EOF
    (the proxy stopped or died)."""
    with contextlib.suppress(OSError):  # below the proxy (and the trainer) for the CPU
        os.nice(10)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while len(head := stdin.read(_HEAD.size)) == _HEAD.size:
        size, max_bytes, block_size = _HEAD.unpack(head)
        body = stdin.read(size)
        if len(body) < size:
            return
        intake = read_generation(body, max_bytes, None if block_size < 0 else block_size)
        data = pickle.dumps(tuple(intake))  # plain values: this module is __main__ here
        del body
        stdout.write(_ANSWER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    _serve()

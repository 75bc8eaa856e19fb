"""What the proxy reads from a generation request's body: decoded, checked, and hashed into its
routing key; small bodies on the event loop, large ones in a worker process.

Why a process, not a thread: decoding a 32 MiB body of millions of one-token prompts, hashing
it and freeing what was decoded take seconds in C calls that hold the GIL, and every other
client of the proxy (in a one-process run, the trainer too) would wait that long. The worker
gets the body's bytes and sends back only what routing needs (:class:`Intake`: a model name,
a stream flag, a cost, a bounded routing key); the proxy forwards the bytes as they came.
Prompt hashes are the same in every process (:mod:`~asyncgrpo.proxy.router`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

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


class Offload:
    """The worker process that reads large bodies, started at the first one (``spawn``: a
    trainer's process holds CUDA and threads, which a fork would copy half-made)."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    async def read(self, body: bytes, max_bytes: int, block_size: int | None) -> Intake:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, read_generation, body, max_bytes, block_size
            )
        except Exception as exc:  # the worker died (killed, out of memory): a new one next time
            log.warning("the body reader process failed (%s: %s); restarting it",
                        type(exc).__name__, exc)  # fmt: skip
            self.close()
            return Intake(503, "the proxy could not read this request body: retry")

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

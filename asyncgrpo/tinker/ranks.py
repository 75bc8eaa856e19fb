"""Data-parallel ranks for the service (``torchrun --nproc-per-node N -m asyncgrpo.tinker``).

Rank 0 runs the HTTP server, the replicas and the transport; its engine is a
:class:`RankedEngine`, and every other rank runs :func:`follow` over an engine of its own. Each
operation that touches weights (create, remove, forward_backward, optim_step, loading a state)
runs on every rank in the order rank 0 issues it: rank 0 scatters one message per rank, every
rank applies its message, and rank 0 gathers the results (one lock on rank 0 keeps that order
whichever thread calls). A ``forward_backward``'s datums are split by tokens over the ranks
(:func:`shard_datums`) and their outputs put back in the request's order
(:func:`merge_results`); ``optim_step`` first sums the adapter's gradients over the ranks.

Why summing gradients is exact: a request's loss is the plain sum of its datums' per-token
losses (no normaliser spans the request, see :mod:`asyncgrpo.tinker.losses`), so the gradient
of the whole request is the sum of the ranks' gradients of their shares, and a sum of several
requests' gradients is summed as well once at the step. Every rank then clips and steps the
same gradient, so the adapters stay equal and rank 0 alone saves and publishes them.

A rank that dies fails the next collective (rank 0 pings idle ranks every
:attr:`RankedEngine.keepalive_s`, so that is soon even with no traffic) with a
:class:`~asyncgrpo.errors.RankError`, which stops the service; rank 0 stopping tells the
others to exit.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.errors import RankError
from asyncgrpo.tinker.engine import AdamStep, Engine, LoraSpec, read_state
from asyncgrpo.tinker.wire import FwdBwdRequest, FwdBwdResult
from asyncgrpo.trainer.packing import plan_rows

__all__ = ["RankedEngine", "follow", "merge_results", "shard_datums"]

logger = logging.getLogger(__name__)

#: Engine methods rank 0 answers alone: they read the adapter, which every rank holds whole.
_LOCAL = frozenset({"check", "has", "spec", "steps", "rank", "save_adapter", "save_state",
                    "dtype_name", "vocab_size", "token_budget", "model"})  # fmt: skip


def shard_datums(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's datum indices (ascending), about equal tokens per rank: longest first onto
    the rank with the fewest tokens so far; a rank gets none only with fewer datums than
    ranks."""
    plan = plan_rows(list(lengths), num_rows=world_size) if lengths else []
    return plan + [[] for _ in range(world_size - len(plan))]


def merge_results(
    count: int, shards: Sequence[Sequence[int]], results: Sequence[FwdBwdResult]
) -> FwdBwdResult:
    """The ranks' results of their ``shards`` as one result over all ``count`` datums, in the
    request's order; ``loss:sum`` is the sum of the ranks'."""
    outputs: list[dict[str, Any] | None] = [None] * count
    for indices, result in zip(shards, results, strict=True):
        for i, output in zip(indices, result.outputs, strict=True):
            outputs[i] = output
    missing = [i for i, out in enumerate(outputs) if out is None]
    if missing:
        raise ValueError(f"datums {missing} are in no rank's shard")
    loss = sum(r.metrics.get("loss:sum", 0.0) for r in results)
    return FwdBwdResult(outputs=outputs, metrics={"loss:sum": loss})  # type: ignore[arg-type]


def _sum_gradients(engine: Engine, dp: Any, model_id: str) -> None:
    """The client's gradients summed over the ranks; a parameter no rank has a gradient for
    keeps none (AdamW skips it, as it does in one process)."""
    params = engine.params(model_id)
    had = dp.sum([float(p.grad is not None) for p in params])
    dp.sum_gradients(params)
    for p, n in zip(params, had, strict=True):
        if n == 0:
            p.grad = None


def _apply(engine: Engine, dp: Any, op: str, args: tuple[Any, ...]) -> Any:
    """Run operation ``op`` on this rank's engine (the same on every rank but its share)."""
    if op == "ping":
        return None
    if op == "create":
        engine.create(*args)
        dp.broadcast_parameters(engine.params(args[0]))  # equal adapters from the start
        return None
    if op == "optim_step":
        _sum_gradients(engine, dp, args[0])
        return engine.optim_step(*args)
    if op == "apply_state":
        model_id, state, optimizer = args
        return engine.apply_state(model_id, state, optimizer=optimizer)
    if op in ("remove", "forward_backward"):
        return getattr(engine, op)(*args)
    raise ValueError(f"unknown operation {op!r} from rank 0")


def _outcome(engine: Engine, dp: Any, message: tuple[str, tuple[Any, ...]]) -> Any:
    """``_apply``'s result, or the exception it raised (to be gathered, not raised here)."""
    try:
        return _apply(engine, dp, *message)
    except RankError:
        raise
    except Exception as exc:
        return exc


def follow(engine: Engine, dp: Any) -> int:
    """Apply rank 0's operations until it says stop (a None message); how many it applied.
    A failed operation is reported to rank 0, not raised: rank 0 decides."""
    count = 0
    while (message := dp.scatter_objects(None)) is not None:
        outcome = _outcome(engine, dp, message)
        if isinstance(outcome, Exception):
            outcome = f"{type(outcome).__name__}: {outcome}"
        dp.gather_objects(outcome)
        count += 1
    logger.info("rank %d: rank 0 stopped after %d operations", dp.rank, count)
    return count


class RankedEngine:
    """Rank 0's engine: the :class:`Engine` interface, each weight operation run on every
    rank. ``keepalive_s``: how often the service pings idle ranks (well within the group's
    timeout, which a rank waiting for its next operation would otherwise run out of)."""

    def __init__(self, engine: Engine, dp: Any) -> None:
        self.engine = engine
        self.dp = dp
        self.keepalive_s = min(60.0, dp.timeout_s / 4)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        if name in _LOCAL:
            return getattr(self.engine, name)
        raise AttributeError(
            f"RankedEngine has no {name!r} (a weight operation must be run on every rank)"
        )

    def _run(self, messages: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Every rank applies its message; the ranks' results. Rank 0's own failure is raised
        as itself; a failure of another rank alone means the adapters may differ: RankError."""
        with self._lock:
            if self._closed:
                raise RankError("the data-parallel ranks were already stopped")
            self._last = time.monotonic()
            self.dp.scatter_objects(list(messages))
            mine = _outcome(self.engine, self.dp, messages[0])
            results = self.dp.gather_objects(None if isinstance(mine, Exception) else mine)
        if isinstance(mine, Exception):
            raise mine
        for rank, result in enumerate(results or []):
            if isinstance(result, str) and rank:
                raise RankError(
                    f"rank {rank} failed {messages[rank][0]} where rank 0 did not "
                    f"({result}): the ranks' adapters may differ, so the service "
                    "stops"
                )
        results[0] = mine  # type: ignore[index]
        return results  # type: ignore[return-value]

    def _everywhere(self, op: str, *args: Any) -> Any:
        return self._run([(op, args)] * self.dp.world_size)[0]

    def idle_s(self) -> float:
        """Seconds since rank 0 last issued an operation."""
        return time.monotonic() - self._last

    def ping(self) -> None:
        """A no-op on every rank: a RankError now if one died while the service was idle."""
        self._everywhere("ping")

    def create(self, model_id: str, spec: LoraSpec) -> None:
        self._everywhere("create", model_id, spec)

    def remove(self, model_id: str) -> None:
        self._everywhere("remove", model_id)

    def optim_step(self, model_id: str, step: AdamStep) -> dict[str, float]:
        return self._everywhere("optim_step", model_id, step)

    def load_state(self, model_id: str, directory: Path, *, optimizer: bool) -> None:
        self._everywhere("apply_state", model_id, read_state(directory), optimizer)

    def forward_backward(self, request: FwdBwdRequest) -> FwdBwdResult:
        """Each rank's token-balanced share of the datums; the outputs in the request's order."""
        self.engine.check(request)  # a bad request goes to no rank
        shards = shard_datums([int(d.tokens.size) for d in request.data], self.dp.world_size)
        messages = [
            (
                "forward_backward",
                (dataclasses.replace(request, data=[request.data[i] for i in shard]),),
            )
            for shard in shards
        ]
        return merge_results(len(request.data), shards, self._run(messages))

    def close(self) -> None:
        """Tell the other ranks to exit (once); a rank already gone is logged, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.dp.scatter_objects([None] * self.dp.world_size)
            except RankError as exc:
                logger.warning("stopping the other ranks: %s", exc)

"""Training runs sharing the replicas: which run a request is for, each run's LoRA slots, and
each run's share of generation while the replicas are saturated.

Pure, like the router beside it: no I/O, no clock reads (callers pass ``now``).

- **Which run.** A request's run is its ``model`` less a trailing ``-v<N>`` (adapter versions
  are named ``<run_name>-<run id>-v<N>``); any other model name is a run of its own. A request
  may name its run instead (the ``X-Asyncgrpo-Run`` header): an evaluation generates under a
  training run's adapter names but takes its own share.
- **LoRA slots.** A run registers how many versions it keeps loaded at most
  (``max_staleness + 2``: load before unload) and its weight. A registration that would take the
  runs past the replicas' ``--max-loras`` is refused, with the numbers; an adapter loaded
  through the proxy by a client that never registered holds one slot. A registration lapses
  after ``lease_s`` without a request of its run (a run that died without saying so).
- **Fair share.** While fewer than ``capacity`` sequences (a request's ``n`` times its prompts)
  are in flight, a request goes at once. Beyond, it waits in its run's queue, and each slot that
  frees goes to the waiting run with the fewest sequences in flight per unit of weight (max-min
  fair: a run that asks less than its share gets all it asks, the others split the rest by
  weight). Routing is untouched: a request whose turn comes is routed by prefix affinity then.
"""

from __future__ import annotations

import functools
import hmac
import re
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

from asyncgrpo.vllm.api import parse_served_name

__all__ = [
    "MAX_NAME",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "NAME",
    "OVERFLOW",
    "TOKEN",
    "Run",
    "Runs",
    "Waiting",
    "booking_refusal",
    "run_of",
    "sequences",
]

#: The run of requests beyond ``max_runs`` distinct runs (all busy): bounded memory, and a
#: bounded number of ``run`` label values on ``/metrics``.
OVERFLOW = "(other)"
#: Longest model or run name (characters): names are cached, kept per run and shown as labels.
MAX_NAME = 256
#: A run's share weight lies in [MIN_WEIGHT, MAX_WEIGHT]: a weight of 5e-324 (or 1e300) would
#: starve a run (or every other run) for good.
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
#: A run name in a registration: printable ASCII, no space.
NAME = re.compile(f"[!-~]{{1,{MAX_NAME}}}")
#: A token a caller chooses for its registration (else the proxy draws one).
TOKEN = re.compile(r"[!-~]{16,256}")


@functools.lru_cache(maxsize=4096)
def run_of(model: str) -> str:
    """``tiny-1a2b3c4d-v12`` -> ``tiny-1a2b3c4d``; a name without a version is its own run."""
    return parsed[0] if (parsed := parse_served_name(model)) else model


def sequences(body: dict[str, Any]) -> int:
    """Sequences a generation request puts in flight: ``n`` per prompt."""
    n = body.get("n", 1)
    if type(n) is not int or n < 1:  # not a bool either
        n = 1
    prompt = body.get("prompt")
    if type(prompt) is list and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)  # a batch of prompts
    return n


class Waiting(Protocol):
    """A request waiting for its turn; ``admitted`` sends it, ``dropped`` answers it ``status``
    and ``message`` instead (its deadline passed, or it was evicted), closing its connection
    if ``close``."""

    def admitted(self) -> None: ...

    def dropped(self, status: int, message: str, *, close: bool) -> None: ...


class Run:
    """One run's registration, its requests now and its totals."""

    __slots__ = (
        "inflight",
        "name",
        "queue",
        "requests",
        "seen",
        "sequence_s",
        "sequences",
        "slots",
        "token",
        "waited_s",
        "weight",
    )

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.weight = 1.0
        self.slots: int | None = None  #: registered LoRA slots; None: not registered
        self.token = ""  #: what its registration answered: needed to re-register or release
        self.seen = now  #: last request or registration
        self.inflight = 0  #: sequences
        self.queue: deque[tuple[Waiting, int, float]] = deque()  # (request, cost, since)
        self.requests = 0
        self.sequences = 0
        self.waited_s = 0.0  #: time requests spent waiting for their turn
        self.sequence_s = 0.0  #: sequence-seconds in flight: its share of generation

    def idle(self) -> bool:
        return not self.inflight and not self.queue

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "weight": self.weight,
            "lora_slots": self.slots,
            "inflight": self.inflight,
            "queued": len(self.queue),
            "requests": self.requests,
            "sequences": self.sequences,
            "waited_s": round(self.waited_s, 3),
            "sequence_s": round(self.sequence_s, 3),
            "idle_s": round(now - self.seen, 1),
        }


class Runs:
    """Every run the proxy has seen (at most ``max_runs`` at once), their slots and turns."""

    def __init__(
        self,
        *,
        lease_s: float,
        max_runs: int = 1024,
        max_queued: int = 4096,
        queue_timeout_s: float = float("inf"),
    ) -> None:
        self.lease_s = lease_s
        self.max_runs = max_runs
        self.max_queued = max_queued  #: requests of one run waiting their turn, at most
        self.queue_timeout_s = queue_timeout_s  #: how long a request may wait for its turn
        self.folded = 0  #: requests counted under OVERFLOW: their run was one too many
        self.runs: dict[str, Run] = {}
        #: sequences one replica runs at once (its --max-num-seqs); None: requests never wait
        self.per_replica: int | None = None
        #: sequences in flight before requests wait their turn; None: they never wait
        self.capacity: int | None = None
        self.inflight = 0
        self.waiting = 0
        self._pumping = False

    # -- requests -------------------------------------------------------------------------

    def run(self, model: str, now: float, *, named: str | None = None) -> Run:
        """The run of a request for ``model``, or the run it ``named`` (created if new)."""
        name = named or run_of(model)
        run = self.runs.get(name)
        if run is None:
            run = self._new(name, now)
            if run is None:
                self.folded += 1
                run = self.runs.get(OVERFLOW) or self.runs.setdefault(OVERFLOW, Run(OVERFLOW, now))
        run.seen = now
        return run

    def _new(self, name: str, now: float) -> Run | None:
        """A new entry, in place of the longest silent idle unregistered run if the table is
        full; None if every entry is busy or registered."""
        if len(self.runs) >= self.max_runs:
            idle = [r for r in self.runs.values() if r.slots is None and r.idle()]
            if not idle:
                return None
            del self.runs[min(idle, key=lambda r: r.seen).name]
        run = self.runs[name] = Run(name, now)
        return run

    def resize(self, replicas: int, now: float) -> None:
        """The capacity of ``replicas`` in rotation; room it adds goes to waiting requests.
        With none in rotation nothing waits: requests fail at once, as they would alone."""
        self.capacity = self.per_replica * replicas if self.per_replica and replicas else None
        if self.waiting:
            self.pump(now)

    def admit(self, run: Run, request: Waiting, cost: int, now: float) -> bool:
        """True: send ``request`` now (it holds ``cost`` sequences until :meth:`done`). False:
        it waits its turn; :meth:`pump` sends it."""
        run.requests += 1
        run.sequences += cost
        if self.capacity is None or self.inflight < self.capacity:
            run.inflight += cost
            self.inflight += cost
            return True
        run.queue.append((request, cost, now))
        self.waiting += 1
        return False

    def queue_full(self, run: Run) -> bool:
        """Whether a request of ``run`` that would wait must be refused instead (429)."""
        return len(run.queue) >= self.max_queued and not (
            self.capacity is None or self.inflight < self.capacity
        )

    def expire_waiting(self, now: float) -> None:
        """Answer 503 to every request that waited ``queue_timeout_s`` for its turn."""
        due = now - self.queue_timeout_s
        for run in [r for r in self.runs.values() if r.queue and r.queue[0][2] <= due]:
            while run.queue and run.queue[0][2] <= due:
                request, _, since = run.queue.popleft()
                self.waiting -= 1
                run.waited_s += now - since
                request.dropped(
                    503,
                    f"waited over queue_timeout_s={self.queue_timeout_s:g} s "
                    "for its run's turn: the replicas are saturated",
                    close=False,
                )

    def evict(self, count: int, now: float) -> int:
        """Drop the ``count`` longest-waiting requests of the run with the most waiting (each
        answered 503, its connection closed: the connection cap needs room); how many."""
        queued = [r for r in self.runs.values() if r.queue]
        if not queued:
            return 0
        run = max(queued, key=lambda r: len(r.queue))
        n = 0
        while run.queue and n < count:
            request, _, since = run.queue.popleft()
            self.waiting -= 1
            run.waited_s += now - since
            n += 1
            request.dropped(
                503,
                "evicted while waiting for its run's turn: the proxy is at "
                "max_connections and this run holds the most waiting requests",
                close=True,
            )
        return n

    def done(self, run: Run, cost: int, seconds: float) -> None:
        """A request that was sent ended after ``seconds``; its sequences are free."""
        run.inflight -= cost
        self.inflight -= cost
        run.sequence_s += cost * seconds

    def withdraw(self, run: Run, request: Waiting) -> None:
        """A waiting request's client went away."""
        for i, (waiting, _, _) in enumerate(run.queue):
            if waiting is request:
                del run.queue[i]
                self.waiting -= 1
                return

    def pump(self, now: float) -> None:
        """Send waiting requests while there is room, each time the run furthest below its
        share first (ties: the longest waiting). A request sent may end at once (no replica)
        and free its room again: that is sent from this loop, not from a nested call."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while self.waiting and (self.capacity is None or self.inflight < self.capacity):
                run = min(
                    (r for r in self.runs.values() if r.queue),
                    key=lambda r: (r.inflight / r.weight, r.queue[0][2]),
                )
                request, cost, since = run.queue.popleft()
                self.waiting -= 1
                run.waited_s += now - since
                run.inflight += cost
                self.inflight += cost
                request.admitted()
        finally:
            self._pumping = False

    # -- registrations --------------------------------------------------------------------

    def expire(self, now: float) -> list[str]:
        """Drop the registrations of runs silent for ``lease_s``; their names."""
        lapsed = [
            r
            for r in self.runs.values()
            if r.slots is not None and r.idle() and now - r.seen > self.lease_s
        ]
        for run in lapsed:
            run.slots, run.token = None, ""
        return [r.name for r in lapsed]

    def holders(self, loaded: Iterable[str], *, besides: str = "") -> dict[str, int]:
        """LoRA slots held per run: registered ones, and one per adapter loaded for a run that
        is not registered (``loaded``: the adapters loaded through the proxy)."""
        registered = {r.name: r.slots for r in self.runs.values() if r.slots is not None}
        held = dict(registered)
        for adapter in loaded:
            name = run_of(adapter)
            if name not in registered:
                held[name] = held.get(name, 0) + 1
        held.pop(besides, None)
        return held

    def register(
        self,
        name: str,
        *,
        slots: int,
        weight: float,
        max_loras: int,
        loaded: Iterable[str],
        now: float,
    ) -> str | None:
        """Register run ``name`` (again: a restarted run replaces its old registration); the
        reason it does not fit, or None."""
        full = len(self.runs) >= self.max_runs
        if (
            full
            and name not in self.runs
            and not any(r.slots is None and r.idle() for r in self.runs.values())
        ):
            return (
                f"the proxy already tracks max_runs={self.max_runs} runs, each busy or "
                "registered: wait for one to end"
            )
        held = self.holders(loaded, besides=name)
        used = sum(held.values())
        if used + slots > max_loras:
            others = ", ".join(f"{n} {k}" for n, k in sorted(held.items())) or "none"
            return (
                f"run {name} needs {slots} LoRA slots (the versions it keeps loaded) but the replicas hold "
                f"--max-loras {max_loras}, {used} of them taken by the {len(held)} other run(s) "
                f"sharing them ({others}): restart the replicas with --max-loras {used + slots} "
                "or more (python -m asyncgrpo.serve --runs N sizes it), or lower max_staleness"
            )
        run = self.runs.get(name) or self._new(name, now)
        assert run is not None  # room was checked above
        run.slots, run.weight, run.seen = slots, weight, now
        return None

    def release(self, name: str) -> bool:
        """The run ended: its slots are free. Its entry stays, unregistered, so that its
        counters remain readable in the stats, until a new run needs its place in a full table
        (:meth:`_new`). False if it was not registered."""
        run = self.runs.get(name)
        if run is None or run.slots is None:
            return False
        run.slots, run.token = None, ""
        return True


def booking_refusal(run: Run | None, token: object) -> str | None:
    """Why a caller holding ``token`` may not re-register or release ``run``, or None: a run's
    registration is its holder's, whose token its registration answered."""
    if run is None or run.slots is None or not run.token:
        return None
    if isinstance(token, str) and hmac.compare_digest(token.encode(), run.token.encode()):
        return None
    return (
        f"run {run.name} is registered by another holder: only the token its registration "
        "answered can re-register or release it (an unused registration lapses after "
        "run_lease_s)"
    )

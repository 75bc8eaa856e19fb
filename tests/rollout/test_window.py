"""AdmissionWindow against a straightforward simulation of the trainer and its rollout client."""

from __future__ import annotations

from collections import deque

import pytest

from asyncgrpo.rollout.window import AdmissionWindow

G, P = 8, 32  # samples per group, samples per optimizer step


def simulate(
    max_staleness: int, sync_every: int, steps: int, lose_every: int = 0
) -> tuple[int, list[int], int]:
    """Instant generation (the worst case: the client could always run ahead).

    Returns (stale samples read, samples admitted before each step, samples lost). The trainer
    reads P samples per step (dropping stale ones and reading more), then publishes a version
    every ``sync_every`` steps, and the client switches to it at once. With ``lose_every`` every
    n-th group comes back one sample short (a failed completion).
    """
    w = AdmissionWindow(per_version=P * sync_every, max_staleness=max_staleness)
    queue: deque[int] = deque()  # versions of the queued samples
    version, stale, groups, lost = 0, 0, 0, 0
    ahead: list[int] = []

    def produce() -> None:
        nonlocal groups, lost
        while w.may_admit(G):
            w.admitted(G)
            groups += 1
            short = 1 if lose_every and groups % lose_every == 0 else 0
            queue.extend([version] * (G - short))
            if short:
                w.lost(short)
                lost += 1

    for step in range(1, steps + 1):
        produce()
        ahead.append(len(queue))
        fresh = 0
        while fresh < P:
            if not queue:  # the trainer blocks: its demand is what lets the client go on
                w.demand = P - fresh
                produce()
                w.demand = 0
                assert queue, "the trainer would wait forever"
            v = queue.popleft()
            w.took(1)
            if version - v > max_staleness:
                stale += 1
            else:
                fresh += 1
        if step % sync_every == 0:
            version += 1
            w.new_version()
    return stale, ahead, lost


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("sync_every", [1, 2])
def test_no_sample_is_started_that_the_trainer_would_drop(max_staleness, sync_every) -> None:
    stale, ahead, _ = simulate(max_staleness, sync_every, steps=12)
    assert stale == 0
    # ... and the client runs as far ahead as staleness allows: the queue holds exactly the
    # window at the start of the first step, and never less than one step's worth afterwards.
    assert ahead[0] == (max_staleness + 1) * sync_every * P
    assert min(ahead) >= P


def test_without_the_window_the_queue_runs_stale() -> None:
    """The reference behaviour the window replaces: a client bounded only by its queue."""
    queue_maxsize, version, stale = 32, 0, 0
    queue: deque[int] = deque()
    for _ in range(10):
        while len(queue) < queue_maxsize:
            queue.append(version)
        for _ in range(P):
            if version - queue.popleft() > 0:
                stale += 1
            queue.append(version)  # refilled while the trainer trains
        version += 1
    assert stale > 0


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_lost_samples_and_a_waiting_trainer_never_deadlock(max_staleness: int) -> None:
    """Short groups leave the trainer short: its demand admits one more group (simulate()
    asserts it never waits forever). At staleness 0 the rest of that group goes stale, at most
    G - 1 samples per step; one version of slack absorbs it."""
    steps = 20
    stale, _, lost = simulate(max_staleness, 1, steps=steps, lose_every=3)
    assert lost > 0
    assert stale <= (steps * (G - 1) if max_staleness == 0 else 0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        AdmissionWindow(per_version=0, max_staleness=0)
    with pytest.raises(ValueError):
        AdmissionWindow(per_version=4, max_staleness=-1)

"""Admission by staleness: start no rollout the trainer would drop as too old.

Without it, a rollout client in the trainer's process keeps its queue full while the trainer
trains; at ``max_staleness=0`` every one of those samples is stale by the time it is read (the
next sync has happened), so most generation is thrown away, and on shared CPUs it also slows the
trainer down (docs/benchmarks.md, "The bar against the learning rate", has the figures).

The trainer reads samples in order, ``per_version`` of them under each of its adapter versions
(``samples_per_step * weight_sync_steps``), and accepts a sample up to ``max_staleness`` versions
old. Version ``v`` reaches the rollout client right after the trainer published it, when the
trainer has read ``base`` samples; a sample started now will be read at position
``consumed + outstanding``, so it is fresh enough iff that position is below
``base + (max_staleness + 1) * per_version``. A consumer blocked on samples that nobody is
generating overrides the window, so the trainer can never wait forever (it may need more
samples than planned after dropping some). Groups finish out of order, so a group admitted at
the window's edge and overtaken by later ones is read later than planned and can still arrive one
version too old: the trainer drops it (``sample/dropped_stale_total``). Only a window that left
``max_inflight`` samples of slack would rule that out, at the cost of that much run-ahead.
"""

from __future__ import annotations

__all__ = ["AdmissionWindow"]


class AdmissionWindow:
    """Counts of one rollout client; pure logic, no I/O."""

    def __init__(self, per_version: int, max_staleness: int) -> None:
        if per_version < 1 or max_staleness < 0:
            raise ValueError(f"per_version={per_version}, max_staleness={max_staleness}")
        self.limit = (max_staleness + 1) * per_version
        self.base = 0  # samples read when the current version arrived
        self.consumed = 0  # samples read so far
        self.outstanding = 0  # admitted, not yet read, not lost
        self.demand = 0  # samples a blocked reader is still waiting for

    def may_admit(self, k: int) -> bool:
        """Whether a group of ``k`` samples may start now."""
        fresh = self.consumed + self.outstanding + k <= self.base + self.limit
        return fresh or self.outstanding < self.demand

    def admitted(self, k: int) -> None:
        self.outstanding += k

    def lost(self, k: int) -> None:
        """``k`` admitted samples will never be read (failed or short group)."""
        self.outstanding -= k

    def took(self, k: int) -> None:
        self.consumed += k
        self.outstanding -= k

    def new_version(self) -> None:
        """The client now generates under a newer version."""
        self.base = self.consumed

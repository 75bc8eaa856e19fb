"""The collapse alarm: has a run that reached its reward started losing it?

Pure logic over the step's mean reward (no I/O, no clock), so it is tested step by step. The
trainer feeds it one reward per optimizer step and acts on the verdict
(``trainer.collapse_action``: warn, stop, roll back).

Why a moving mean against the run's own start and best, not a fixed reward level: reward
scales differ between tasks, and a single bad step is noise. The alarm arms once the moving
mean has gained ``min_gain`` over its first full window, and fires when it falls ``drop`` of
the way from its best back to that start. It fires once, then stays quiet until the moving
mean is back above the alarm level (a recovery), so a collapse gives one line, not one per step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    """What one step's reward says."""

    mean: float  #: moving mean of the last ``window`` rewards (NaN until the window is full)
    best: float  #: best moving mean so far (NaN until the window is full)
    start: float  #: the first full window's mean (NaN until then)
    new_best: bool  #: this step set a new best (a rollback target)
    alarm: bool  #: this step crossed the alarm level (fires once per collapse)


@dataclass
class CollapseDetector:
    """Feed ``update(reward)`` once per step; ``Verdict.alarm`` marks the step to act on."""

    window: int = 5
    drop: float = 0.5
    min_gain: float = 0.1
    _recent: deque[float] = field(default_factory=deque, init=False, repr=False)
    start: float = field(default=math.nan, init=False)
    best: float = field(default=math.nan, init=False)
    best_step: int = field(default=-1, init=False)
    fired: bool = field(default=False, init=False)
    steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window={self.window}: must be >= 1")
        if not 0 < self.drop <= 1:
            raise ValueError(f"drop={self.drop}: must be in (0, 1]")
        if not self.min_gain >= 0:
            raise ValueError(f"min_gain={self.min_gain}: must be >= 0")

    @property
    def armed(self) -> bool:
        """The run has reached something worth keeping."""
        return not math.isnan(self.best) and self.best - self.start >= self.min_gain

    @property
    def level(self) -> float:
        """The moving mean below which the alarm fires (NaN while not armed)."""
        if not self.armed:
            return math.nan
        return self.best - self.drop * (self.best - self.start)

    def update(self, reward: float) -> Verdict:
        """One step's mean reward (NaN: a step without valid rewards, skipped)."""
        self.steps += 1
        if not math.isnan(reward):
            self._recent.append(reward)
            if len(self._recent) > self.window:
                self._recent.popleft()
        if len(self._recent) < self.window:
            return Verdict(math.nan, self.best, self.start, False, False)
        mean = math.fsum(self._recent) / len(self._recent)
        if math.isnan(self.start):
            self.start = mean
        new_best = math.isnan(self.best) or mean > self.best
        if new_best:
            self.best, self.best_step = mean, self.steps
        alarm = False
        if self.armed:
            below = mean < self.level
            alarm = below and not self.fired
            if alarm:
                self.fired = True
            elif not below:
                self.fired = False  # recovered: a later collapse fires again
        return Verdict(mean, self.best, self.start, new_best, alarm)

    def forget_recent(self) -> None:
        """Drop the window (after a rollback: the rewards so far are the collapsed policy's);
        the alarm stays latched until the moving mean is back above its level."""
        self._recent.clear()

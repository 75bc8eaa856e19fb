"""Gradient-norm clipping against the run's own recent gradient norms (``trainer.spike_clip_z``).

A fixed ``max_grad_norm`` does not see a spike relative to what came before it: after converged
steps of norm 0.000-0.005, a gradient of norm 9 clipped to 1 is still ~14x the coordinates'
second-moment history, and AdamW turns it into the largest step it can take. ZClip (Kumar et
al. 2025) and spike-aware clipping keep an exponential moving mean and variance of the norm and
clip a step whose norm lies more than ``z`` standard deviations above the mean to that level,
before the optimizer; the statistics are updated with the clipped norm, so one spike does not
raise the level the next one is judged by.

Steps whose gradient is exactly 0 (every group converged: zero advantages) and non-finite ones
are skipped, neither clipped nor counted: a run of them would otherwise drag the mean and the
spread to 0, and the first gradient after them, however ordinary, would be cut to nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SpikeClip:
    """The running statistics and the clip factor of each step (pure: no tensors, no I/O)."""

    z: float
    """Clip a norm above ``mean + z * std`` to that level."""
    decay: float = 0.97
    """EMA factor of the mean and variance (the weight of the past; ~1 / (1 - decay) steps)."""
    warmup: int = 5
    """Non-zero steps whose norms only seed the statistics (their plain mean and variance);
    at least 1."""
    mean: float = 0.0
    var: float = 0.0
    seen: list[float] = field(default_factory=list)
    """The warm-up's norms, until the statistics are seeded."""

    @property
    def ready(self) -> bool:
        """Whether the warm-up is over (the clip acts from the next non-zero step)."""
        return len(self.seen) >= self.warmup

    def threshold(self) -> float:
        """The largest norm let through now (inf during the warm-up)."""
        if not self.ready:
            return math.inf
        return self.mean + self.z * math.sqrt(self.var)

    def factor(self, norm: float) -> float:
        """The factor (<= 1) this step's gradient of ``norm`` is multiplied by, and the
        statistics updated with the clipped norm. 1 for a zero or non-finite norm (skipped)."""
        if not math.isfinite(norm) or norm <= 0.0:
            return 1.0
        if not self.ready:
            self.seen.append(norm)
            if len(self.seen) >= self.warmup:
                n = len(self.seen)
                self.mean = sum(self.seen) / n
                self.var = sum((x - self.mean) ** 2 for x in self.seen) / n
            return 1.0
        level = self.threshold()
        scale = min(1.0, level / norm)
        clipped = norm * scale
        self.mean = self.decay * self.mean + (1 - self.decay) * clipped
        self.var = self.decay * self.var + (1 - self.decay) * (clipped - self.mean) ** 2
        return scale

    def state_dict(self) -> dict[str, float | list[float]]:
        """The statistics, for a checkpoint (a resumed run judges spikes as before)."""
        return {"mean": self.mean, "var": self.var, "seen": list(self.seen)}

    def load_state_dict(self, state: dict[str, float | list[float]]) -> None:
        self.mean = float(state["mean"])  # type: ignore[arg-type]
        self.var = float(state["var"])  # type: ignore[arg-type]
        self.seen = [float(x) for x in state["seen"]]  # type: ignore[union-attr]

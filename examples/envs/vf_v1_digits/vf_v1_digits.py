"""A single-turn verifiers 0.4 (``verifiers.v1``) taskset: the demo's digits task (the prompts
of ``examples/tiny_cpu.yaml``), rewarded by a ``@vf.reward`` rubric that is
:func:`asyncgrpo.testing.rewards.digit_fraction` of the model's one reply. No tools: the
episode is one model call.

``rollout.environment: {verifiers: vf-v1-digits}`` once installed (``pip install -e
examples/envs/vf_v1_digits``); the run's ``dataset`` section supplies the rows (``load`` below is
what ``vf eval`` would read).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

from asyncgrpo.testing.rewards import digit_fraction

__all__ = ["DigitsTaskset"]

PROMPTS = ["count to five", "name a color", "what is two plus two", "pick a number"]


class DigitsTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, trace: vf.Trace) -> float:
        """The share of digits among the reply's non-blank characters."""
        return digit_fraction([None], [trace.last_reply])[0]


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self) -> Iterable[DigitsTask]:
        for prompt in PROMPTS:
            yield DigitsTask(vf.TaskData(prompt=prompt), self.config.task)

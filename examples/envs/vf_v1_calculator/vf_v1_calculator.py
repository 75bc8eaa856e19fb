"""A verifiers 0.4 (``verifiers.v1``) taskset for the tiny CPU model: the calculator task of
``asyncgrpo.testing.envs``, written in verifiers' own style (a ``TaskData`` model, a ``Task``
with ``@vf.reward`` methods, a ``Toolset`` with an ``@vf.tool``, a ``Taskset`` whose ``load``
yields tasks). Needs verifiers 0.4 (``verifiers.v1``).

``rollout.environment: {verifiers: vf-v1-calculator}`` once installed (``pip install -e
examples/envs/vf_v1_calculator``): verifiers resolves a taskset id to the installed module of that
name (dashes read as underscores); its default harness is
verifiers' chat loop, which calls the ``add`` tool over MCP for as many turns as the model asks.

The rewards are those of :mod:`asyncgrpo.testing.vf_calculator`: half the share of digits in
the last answer, plus 1.0 when it holds the sum (the ``answer`` field).
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

from asyncgrpo.testing.envs import calculator_tasks

__all__ = ["CalculatorTaskset"]


class CalculatorData(vf.TaskData):
    answer: str = ""


class CalculatorTools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def digits(self, trace: vf.Trace) -> float:
        """Half the share of digits among the last answer's non-blank characters."""
        chars = [c for c in trace.last_reply if not c.isspace()]
        return 0.5 * sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0

    @vf.reward
    async def correct_sum(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(bool(task.answer) and task.answer in trace.last_reply)


class CalculatorTaskset(vf.Taskset[CalculatorTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        """The add tool keeps no state: one server for every episode (a task's own toolsets
        would start one per episode, a Python importing verifiers, seconds each)."""
        return [CalculatorTools(vf.ToolsetConfig())]

    def load(self) -> Iterable[CalculatorTask]:
        for row in calculator_tasks(64):
            data = CalculatorData(prompt=row["prompt"], answer=row["answer"])
            yield CalculatorTask(data, self.config.task)


if __name__ == "__main__":  # verifiers starts a tool server as `python -m <its module>`
    CalculatorTools.run()

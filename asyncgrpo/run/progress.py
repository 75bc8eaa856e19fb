"""What a run tells its user while it runs, and the progress lines a launched job prints.

One implementation for every command that trains or generates: ``asyncgrpo train``, ``demo``,
``rollout`` and ``launch``. A run reports to a :class:`RunProgress`: ``phase(text)`` for what it
is doing before the first step (model check, replicas starting, first version published) and
``step(step, metrics)`` after each optimizer step. :class:`ConsoleProgress` shows that as lines,
and the steps as a progress bar on a terminal or one line per step elsewhere (a log, a pipe).

A launched trainer job's only channel back to the launcher is its log, so each of its steps
prints one line ``asyncgrpo-progress {json}`` (:func:`progress_line`), which the launcher reads
back (:func:`parse_progress`) and shows with the same :func:`describe_progress`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from asyncgrpo.run.metrics import METRICS_FILE

if TYPE_CHECKING:
    from asyncgrpo.store.run_documents import RunResult

PREFIX = "asyncgrpo-progress "

#: (field in the line, metric of the trainer)
_FIELDS = (
    ("reward", "reward"),
    ("ratio", "ratio"),
    ("staleness", "sample/staleness_mean"),
    ("version", "adapter_version"),
    ("sync_s", "perf/weight_sync_s"),
    ("step_s", "perf/step_s"),
    ("replicas", "fleet/in_rotation"),
    ("eval_version", "eval/version"),  # the last held-out evaluation finished
    ("eval_reward", "eval/reward"),
)

#: (field, label, format) of :func:`describe_progress`, in the order shown
_SHOWN = (
    ("reward", "reward", "{:.3f}"),
    ("ratio", "ratio", "{:.4f}"),
    ("staleness", "staleness", "{:.2f}"),
    ("version", "v", "{:.0f}"),
    ("sync_s", "sync", "{:.2f} s"),
    ("step_s", "step", "{:.2f} s"),
    ("replicas", "replicas", "{:.0f}"),
    ("eval_version", "eval v", "{:.0f}"),
    ("eval_reward", "eval reward", "{:.3f}"),
)

StepCallback = Callable[[int, dict[str, float]], None]


def progress_record(step: int, max_steps: int, metrics: Mapping[str, float]) -> dict[str, Any]:
    """One step's record; metrics the step did not produce (no sync this step) are left out."""
    record: dict[str, Any] = {"step": step, "max_steps": max_steps}
    for name, key in _FIELDS:
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            record[name] = float(value)
    return record


def progress_line(step: int, max_steps: int, metrics: Mapping[str, float]) -> str:
    """One step's line for the launcher: :data:`PREFIX` and the record as JSON."""
    return PREFIX + json.dumps(progress_record(step, max_steps, metrics))


def parse_progress(line: str) -> dict[str, Any] | None:
    """The record of a progress line (anywhere in ``line``, after a log prefix); else None."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(PREFIX) :])
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def _fields(record: Mapping[str, Any]) -> list[str]:
    return [
        f"{label} {fmt.format(record[name])}"
        for name, label, fmt in _SHOWN
        if isinstance(record.get(name), int | float)
    ]


def describe_progress(record: Mapping[str, Any]) -> str:
    """``step 3/40  reward 0.125  ratio 1.0000  staleness 0.50  v 2  sync 0.41 s  step 1.20 s
    eval v 0  eval reward 0.062`` (fields the step lacks omitted), after the run's name for a sweep's (``lr-1: step 3/40``)."""
    head = f"step {record['step']}/{record.get('max_steps', '?')}"
    if "run" in record:
        head = f"{record['run']}: {head}"
    return "  ".join([head, *_fields(record)])


class RunProgress(Protocol):
    """What a run reports to while it runs."""

    def phase(self, text: str) -> None:
        """A phase before the first step began or ended (one line of text)."""

    def step(self, step: int, metrics: dict[str, float]) -> None:
        """Optimizer step ``step`` is done; ``metrics`` are its metrics line."""


class StepsOnly:
    """A plain step callback as a :class:`RunProgress` (phases are not reported)."""

    def __init__(self, callback: StepCallback) -> None:
        self._callback = callback

    def phase(self, text: str) -> None:
        pass

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._callback(step, metrics)


class Silent:
    """Reports nothing: ``--quiet``, and a run given no progress."""

    def phase(self, text: str) -> None:
        pass

    def step(self, step: int, metrics: dict[str, float]) -> None:
        pass


class JobLines:
    """A launched trainer job's: phases as plain lines in its log (the launcher's failure
    message shows the last ones), each step as a :func:`progress_line` the launcher reads."""

    def __init__(self, max_steps: int, stream: TextIO | None = None) -> None:
        self.max_steps = max_steps
        self.stream = stream

    def phase(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        print(
            progress_line(step, self.max_steps, metrics), file=self.stream or sys.stdout, flush=True
        )


def as_progress(progress: RunProgress | StepCallback | None) -> RunProgress:
    """``progress`` as a :class:`RunProgress`: a plain callback gets the steps only."""
    if progress is None:
        return Silent()
    if hasattr(progress, "phase") and hasattr(progress, "step"):
        return progress  # type: ignore[return-value]
    return StepsOnly(progress)  # type: ignore[arg-type]


class ConsoleProgress:
    """Phases as lines; steps as a progress bar on a terminal, else one line per step.

    A context manager: the bar is closed on exit, so the lines after it start on their own line.
    """

    def __init__(
        self, max_steps: int, *, stream: TextIO | None = None, bar: bool | None = None
    ) -> None:
        self.max_steps = max_steps
        self.stream = stream if stream is not None else sys.stdout
        self.bar = bar if bar is not None else _bar_fits(self.stream)
        self._started = time.monotonic()
        self._bar: Any = None

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def phase(self, text: str) -> None:
        line = f"[{time.monotonic() - self._started:5.0f} s] {text}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        record = progress_record(step, self.max_steps, metrics)
        if not self.bar:
            print(describe_progress(record), file=self.stream, flush=True)
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.max_steps,
                initial=step - 1,
                desc="training",
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
            )
        self._bar.set_postfix_str("  ".join(_fields(record)), refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _bar_fits(stream: TextIO) -> bool:
    """Whether a progress bar can be drawn on ``stream``: a terminal that reports a width. Some
    CI and container pseudo-terminals report 0 columns, where a bar sized to the width draws
    nothing at all: those get one line per step, as a pipe does."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # a closed or stand-in stream
        return False


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _held_out(evals: Sequence[Mapping[str, Any]]) -> list[str]:
    """The held-out result: the first evaluation and the last (base and final version)."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]

    def at(record: Mapping[str, Any], key: str, fmt: str) -> str:
        value = record.get(key)
        ok = isinstance(value, int | float) and math.isfinite(value)
        return fmt.format(value) if ok else "?"

    prompts = at(last, "eval/prompts", "{:.0f}")
    if first is last:
        return [
            f"held-out reward: {at(last, 'eval/reward', '{:.3f}')} (version "
            f"{at(last, 'eval/version', '{:.0f}')}, {prompts} prompts; pass@1 "
            f"{at(last, 'eval/pass@1', '{:.2f}')})"
        ]
    return [
        f"held-out reward: {at(first, 'eval/reward', '{:.3f}')} (version "
        f"{at(first, 'eval/version', '{:.0f}')}) -> {at(last, 'eval/reward', '{:.3f}')} "
        f"(version {at(last, 'eval/version', '{:.0f}')}) over {prompts} prompts the trainer never "
        f"saw; pass@1 {at(first, 'eval/pass@1', '{:.2f}')} -> {at(last, 'eval/pass@1', '{:.2f}')}"
    ]


def summary_lines(
    result: RunResult,
    records: Sequence[Mapping[str, Any]],
    wall_s: float,
    *,
    first: int = 5,
    evals: Sequence[Mapping[str, Any]] = (),
    where: str = "",
    max_steps: int | None = None,
) -> list[str]:
    """What ``asyncgrpo train`` and ``asyncgrpo launch`` say at the end: steps this time and in
    all, where it resumed, reward over this run's first and last ``first`` steps, the held-out
    result (``evals``: its evaluations, base first), wall time, and where the outputs are: the
    final adapter version and its transport, its PEFT directory, the metrics. ``where``: said
    after the paths when they are on another machine (a launched trainer job's)."""
    resumed = result.resumed_from_step
    start = resumed or 0
    if result.up_to_date:
        limit = f" (trainer.max_steps={max_steps})" if max_steps is not None else ""
        lines = [
            f"nothing to train: the run's checkpoint is at step {result.steps}{limit}; raise "
            "trainer.max_steps to train on (nothing was started or published)"
        ]
    else:
        trained = result.steps - start
        head = f"trained {_plural(trained, 'step')} in {wall_s:.0f} s"
        if resumed is not None:
            head += f" (resumed from the checkpoint of step {resumed}; {result.steps} steps in all)"
        lines = [head]
    rewards = [
        float(r["reward"])
        for r in records
        if int(r.get("step", 0)) > start
        and isinstance(r.get("reward"), int | float)
        and math.isfinite(r["reward"])
    ]
    if rewards and not result.up_to_date:
        n = min(first, len(rewards))
        lines.append(
            f"reward {_mean(rewards[:n]):.3f} -> {_mean(rewards[-n:]):.3f} "
            f"(mean of the first and last {_plural(n, 'step')} of this run)"
        )
    lines += _held_out(evals)
    if result.final_version >= 0:
        lines.append(
            f"final adapter: {result.adapter_prefix}-v{result.final_version} in "
            f"{result.transport_url}"
        )
    if result.adapter_dir is not None:
        lines.append(f"PEFT directory: {result.adapter_dir}{where}")
    metrics = result.run_dir / METRICS_FILE
    if where or metrics.is_file():  # logging.jsonl may be off
        lines.append(f"metrics: {metrics}{where}")
        if not where:
            lines.append(f"plot: asyncgrpo plot {result.run_dir}")
    return lines


def run_summary(result: RunResult, wall_s: float, *, max_steps: int | None = None) -> list[str]:
    """:func:`summary_lines` of a run whose directory is on this host: its metrics and its
    evaluations read from there."""
    from asyncgrpo.evaluation.records import read_evals
    from asyncgrpo.run.metrics import read_metrics

    metrics = result.run_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.is_file() else []
    return summary_lines(
        result, records, wall_s, evals=read_evals(result.run_dir), max_steps=max_steps
    )


#: How a launched trainer job reports its result to the launcher: one line at its end.
RESULT_PREFIX = "asyncgrpo-result "


def result_line(result: RunResult, evals: Sequence[Mapping[str, Any]]) -> str:
    """The line a launched trainer job prints last: :data:`RESULT_PREFIX`, its result and its
    first and last evaluation as JSON, for the launcher's summary (:func:`parse_result`)."""
    doc = {k: str(v) if isinstance(v, os.PathLike) else v for k, v in vars(result).items()}
    kept = [evals[0], evals[-1]] if len(evals) > 1 else list(evals)
    doc["evals"] = [
        {k: v for k, v in e.items() if isinstance(v, int | float) and math.isfinite(v)}
        for e in kept
    ]
    return RESULT_PREFIX + json.dumps(doc)


def parse_result(line: str) -> tuple[RunResult, list[dict[str, Any]]] | None:
    """The (result, evaluations) of a :func:`result_line` anywhere in ``line``; else None."""
    from pathlib import Path

    from asyncgrpo.store.run_documents import RunResult

    at = line.find(RESULT_PREFIX)
    if at < 0:
        return None
    try:
        doc = json.loads(line[at + len(RESULT_PREFIX) :])
        evals = [e for e in doc.pop("evals", []) if isinstance(e, dict)]
        doc["run_dir"] = Path(doc["run_dir"])
        if doc.get("adapter_dir") is not None:
            doc["adapter_dir"] = Path(doc["adapter_dir"])
        return RunResult(**doc), evals
    except (ValueError, TypeError, KeyError, AttributeError):
        return None

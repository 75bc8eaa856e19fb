"""``plot_run(run_dir)``: a run's metrics as one PNG; ``plot_runs(path)``: each run found at
``path`` (a run directory, a launch directory or the run directory above it; a sweep's: every
point), for ``asyncgrpo plot``.

Panels: reward; ``ratio`` (trainer over vLLM on on-policy tokens: must stay ~1); step time;
staleness of the trained samples; the share of tokens at each staleness (stacked); the
importance weight pi_trainer / pi_vllm per staleness (mean, and the step's maximum); the share
of tokens the off-policy correction truncated or masked. With evaluations
(``eval_metrics.jsonl``), one more row against the version evaluated: the held-out reward (with
its spread) and pass@1 / pass@k.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.records import read_evals
from asyncgrpo.run.metrics import METRICS_FILE, read_metrics

PLOT_FILE = "plot.png"
_PER_STALENESS = re.compile(r"^off_policy/staleness_(\d+)/tokens$")
_PASS_AT = re.compile(r"^eval/pass@(\d+)$")

# (title, [(metric key, label)], y reference line or None)
Panel = tuple[str, list[tuple[str, str]], float | None]


def _series(
    records: list[dict[str, Any]], key: str, x: str = "step"
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not math.isnan(v):
            xs.append(float(r[x]))
            ys.append(float(v))
    return xs, ys


def _panels(staleness: list[int]) -> list[Panel]:
    per = lambda what: [(f"off_policy/staleness_{s}/{what}", f"staleness {s}") for s in staleness]  # noqa: E731
    return [
        ("reward", [("reward", "mean")], None),
        ("ratio on on-policy tokens (must stay ~1)", [("ratio", "mean r")], 1.0),
        ("step time [s]", [("perf/step_s", "step"), ("perf/fwd_bwd_s", "fwd+bwd")], None),
        (
            "staleness [versions]",
            [("sample/staleness_mean", "mean"), ("sample/staleness_max", "max")],
            None,
        ),
        ("tokens by staleness (share)", per("tokens"), None),
        ("importance weight pi_trainer / pi_vllm: mean", per("weight_mean"), 1.0),
        ("importance weight: step maximum", per("weight_max"), 1.0),
        (
            "tokens cut by the correction (share)",
            [("off_policy/truncated", "truncated"), ("off_policy/masked", "masked")],
            None,
        ),
    ]


def find_metrics(path: str | Path) -> dict[str, Path]:
    """Run name -> ``metrics.jsonl`` of each run at ``path``: a run directory's own, else those
    the launch manifest (``jobs.json``, in ``path`` or ``path/launch``) names that exist. None
    found: :class:`ConfigError` saying what to give instead."""
    import json

    from asyncgrpo.launch.manifest import MANIFEST_FILE, trainer_metrics

    path = Path(path)
    if (path / METRICS_FILE).is_file():
        return {path.name: path / METRICS_FILE}
    manifests = [m for m in (path / MANIFEST_FILE, path / "launch" / MANIFEST_FILE) if m.is_file()]
    if not manifests:
        raise ConfigError(
            f"{path} has no {METRICS_FILE}: give a run directory, <output_dir>/<run_name> of a "
            "config (e.g. runs/demo), or a launch directory (<output_dir>/<run_name>/launch)"
        )
    try:
        named = trainer_metrics(json.loads(manifests[0].read_text()), manifests[0].parent)
    except ValueError as exc:
        raise ConfigError(f"{manifests[0]} is not a launch manifest: {exc}") from None
    found = {run: metrics for run, metrics in named.items() if metrics.is_file()}
    if found:
        return found
    where = manifests[0].parent
    if not named:
        raise ConfigError(
            f"the launch in {where} kept no {METRICS_FILE} on this host: its "
            "trainer jobs wrote theirs on their own machines"
        )
    expected = ", ".join(str(m) for m in named.values())
    raise ConfigError(f"the launch in {where} has no {METRICS_FILE} yet (expected: {expected})")


def plot_runs(path: str | Path) -> dict[str, Path]:
    """Plot every run :func:`find_metrics` finds at ``path``: run name -> its PNG."""
    return {run: plot_run(metrics.parent) for run, metrics in find_metrics(path).items()}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/plot.png``); return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    staleness = sorted(
        {int(m.group(1)) for r in records for k in r if (m := _PER_STALENESS.match(k))}
    )
    panels = _panels(staleness)
    evals = read_evals(run_dir)
    rows = len(panels) // 2 + (1 if evals else 0)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 2.6 * rows), squeeze=False)
    trained = axes.flat[: len(panels)]
    for ax, (title, keys, ref) in zip(trained, panels, strict=True):
        ax.sharex(trained[0])
        if title.startswith("tokens by staleness"):
            drawn = _stacked(ax, records, keys)
        else:
            drawn = _lines(ax, records, keys, log="maximum" in title)
        if ref is not None and drawn:
            ax.axhline(ref, color="grey", linestyle="--", linewidth=0.8)
            _plain_ticks(ax)
        _finish_panel(ax, title, drawn)
    for ax in trained[-2:]:
        ax.set_xlabel("optimizer step")
    if evals:
        _eval_panels(axes[-1], evals)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _finish_panel(ax: Any, title: str, drawn: bool) -> None:
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def _eval_panels(axes: Any, evals: list[dict[str, Any]]) -> None:
    """The held-out reward (± its spread over completions) and pass@1 / pass@k, against the
    version evaluated."""
    reward_ax, pass_ax = axes
    xs, ys = _series(evals, "eval/reward", x="eval/version")
    if xs:
        reward_ax.plot(xs, ys, marker="o", linewidth=1.2, label="held-out reward")
        _, sd = _series(evals, "eval/reward_std", x="eval/version")
        if len(sd) == len(ys):
            reward_ax.fill_between(
                xs,
                [y - d for y, d in zip(ys, sd, strict=True)],
                [y + d for y, d in zip(ys, sd, strict=True)],
                alpha=0.2,
                label="± std over completions",
            )
    _finish_panel(reward_ax, "held-out reward", bool(xs))
    ks = sorted({int(m.group(1)) for r in evals for k in r if (m := _PASS_AT.match(k))})
    drawn = False
    for k in ks:
        px, py = _series(evals, f"eval/pass@{k}", x="eval/version")
        if px:
            pass_ax.plot(px, py, marker="o", linewidth=1.2, label=f"pass@{k}")
            drawn = True
    _finish_panel(pass_ax, "held-out pass@k", drawn)
    for ax in axes:
        ax.set_xlabel("adapter version evaluated")


def _plain_ticks(ax: Any) -> None:
    """Tick labels as values (``1.0000001``), not an offset (``1e-7+1``) to add in one's head:
    a ratio or weight near 1 is read against 1."""
    from matplotlib.ticker import ScalarFormatter

    if ax.get_yscale() == "linear":
        ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))


def _lines(ax: Any, records: list[dict[str, Any]], keys: list[tuple[str, str]], log: bool) -> bool:
    drawn = False
    steps = [float(r["step"]) for r in records]
    for key, label in keys:
        xs, ys = _series(records, key)
        if not xs:
            continue
        if len(xs) < len(records):  # sparse: NaN gaps break the line, points show lone values
            got = dict(zip(xs, ys, strict=True))
            ax.plot(
                steps, [got.get(x, math.nan) for x in steps], label=label, linewidth=1.2, marker="."
            )
        else:
            ax.plot(xs, ys, label=label, linewidth=1.2)
        drawn = True
        if key == "reward":
            sx, sd = _series(records, "reward_std")
            std = dict(zip(sx, sd, strict=True))
            lo = [y - std.get(x, 0.0) for x, y in zip(xs, ys, strict=True)]
            hi = [y + std.get(x, 0.0) for x, y in zip(xs, ys, strict=True)]
            ax.fill_between(xs, lo, hi, alpha=0.2, label="± group std")
    if drawn and log:
        ax.set_yscale("log")
    return drawn


def _stacked(ax: Any, records: list[dict[str, Any]], keys: list[tuple[str, str]]) -> bool:
    """One stacked bar per step: the step's tokens by staleness."""
    if not keys or not records:
        return False
    xs = [float(r["step"]) for r in records]
    bottom = [0.0] * len(records)
    for key, label in keys:
        values = [r.get(key) for r in records]
        ys = [v if isinstance(v, int | float) and not math.isnan(v) else 0.0 for v in values]
        ax.bar(xs, ys, width=1.0, bottom=bottom, label=label, alpha=0.85)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_ylim(0, 1)
    return True

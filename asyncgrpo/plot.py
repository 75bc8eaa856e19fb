"""``plot_run(run_dir)``: reward, ratio, step time and staleness of a run, as one PNG."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from asyncgrpo.metrics import read_metrics

PLOT_FILE = "plot.png"

# (title, [(metric key, label)], y reference line or None)
_PANELS: list[tuple[str, list[tuple[str, str]], float | None]] = [
    ("reward", [("reward", "mean")], None),
    ("ratio (must stay ~1)", [("ratio", "mean r")], 1.0),
    ("step time [s]", [("perf/step_s", "step"), ("perf/fwd_bwd_s", "fwd+bwd")], None),
    (
        "staleness [versions]",
        [("sample/staleness_mean", "mean"), ("sample/staleness_max", "max")],
        None,
    ),
]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not math.isnan(v):
            xs.append(float(r["step"]))
            ys.append(float(v))
    return xs, ys


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``run_dir/metrics.jsonl`` into ``out`` (default ``run_dir/plot.png``); return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (title, keys, ref) in zip(axes.flat, _PANELS, strict=True):
        drawn = False
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, label=label, linewidth=1.2)
                drawn = True
                if key == "reward":
                    sx, sd = _series(records, "reward_std")
                    std = dict(zip(sx, sd, strict=True))
                    lo = [y - std.get(x, 0.0) for x, y in zip(xs, ys, strict=True)]
                    hi = [y + std.get(x, 0.0) for x, y in zip(xs, ys, strict=True)]
                    ax.fill_between(xs, lo, hi, alpha=0.2, label="± group std")
        if ref is not None and drawn:
            ax.axhline(ref, color="grey", linestyle="--", linewidth=0.8)
        if not drawn:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

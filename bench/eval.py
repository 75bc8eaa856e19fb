"""What evaluating during training costs the trainer: the demo recipe with and without
``eval.every``, side by side in one invocation, on one fleet; with ``--curve``, the held-out
reward by version at each ``max_staleness``.

Every run is ``examples/tiny_cpu.yaml`` (the ``asyncgrpo demo`` recipe: the tiny model, two
float32 vLLM replicas behind the proxy, 32 samples per step, a sync every step, 40 steps, its
4 held-out prompts x 4 completions evaluated before the first step and after the last) with
``eval.every`` 0 (``off``) or N (``on``: every N-th version also evaluated while the trainer
goes on). One fleet is started once, sized for the pinned version (``--max-loras``
``max_staleness + 3``), and each seed runs both, off first for the 1st, 3rd, ... seed and on
first for the others, so that a drift of the host's load, or a warm-up, hits both alike.

Columns: ``s/step`` (median ``perf/step_s``), ``steps/s`` (steps over the sum of their
``perf/step_s``: the training loop, the base and final evaluations excluded), ``step>=0.5`` and
``s to 0.5`` (first step whose 3-step mean reward reaches 0.5, and the loop's seconds until
then), ``evals`` (evaluations during training), ``held-out`` (eval reward of the base model ->
the final version), ``wall`` (the whole run). The last lines give the on / off ratios.

``--curve``: whether asynchronous training generalises as well as synchronous. The same recipe
with ``eval.every`` N at each ``--staleness`` (0 and 4), every seed (0, 1, 2), on one fleet, the
staleness order alternating by seed. The table gives the held-out ``eval/reward`` per version
evaluated (mean over the seeds that evaluated it, min and max, how many), then base -> final per
run, with the training reward of its last 5 steps; ``curve.png`` in ``--out`` draws eval reward
against version, the mean per staleness thick, each seed thin.

Run: ``python bench/eval.py [--every 5] [--seeds 0] [--steps 40]``,
``python bench/eval.py --curve [--staleness 0,4] [--seeds 0,1,2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
OUT = ROOT / "runs" / "bench-eval"
THRESHOLD, WINDOW = 0.5, 3


def reached(rewards: list[float]) -> int | None:
    """1-based step at which the WINDOW-step mean reward first reaches THRESHOLD."""
    for k in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[k - WINDOW : k]) >= THRESHOLD:
            return k
    return None


def figures(run_dir: Path, wall: float | None = None) -> dict[str, Any]:
    """A run's figures from its directory (``wall``: the whole run's seconds, when timed)."""
    from asyncgrpo.evaluation.records import read_evals
    from asyncgrpo.run.metrics import read_metrics

    records = read_metrics(run_dir)
    rewards = [float(r["reward"]) for r in records]
    step_s = [float(r["perf/step_s"]) for r in records]
    at = reached(rewards)
    evals = read_evals(run_dir)
    curve = {int(e["eval/version"]): float(e["eval/reward"]) for e in evals}
    # the training reward beside version v's held-out one: step v+1's, which trained on samples
    # of version v (and, when max_staleness > 0, of up to that many older versions)
    train = {v: rewards[v] for v in curve if v < len(rewards)}
    return {
        "curve": curve,
        "train": train,
        "gap": statistics.fmean(curve[v] - train[v] for v in train),
        "last5": statistics.fmean(rewards[-5:]),
        "s_step": statistics.median(step_s),
        "steps_per_s": len(step_s) / sum(step_s),
        "step": at,
        "secs": sum(step_s[:at]) if at else None,
        "evals": len(evals) - 2,
        "held": (evals[0]["eval/reward"], evals[-1]["eval/reward"]),
        "wall": wall,
    }


Job = tuple[str, list[str]]  # run name, config overrides


def comparison(args: argparse.Namespace) -> list[Job]:
    """Each seed without and with evaluation, off first for the 1st, 3rd, ... seed."""
    jobs = []
    for i, seed in enumerate(args.seeds):
        order = [("off", 0), ("on", args.every)]
        for label, every in order if i % 2 == 0 else order[::-1]:
            jobs.append((f"{label}-s{seed}", [f"seed={seed}", f"eval.every={every}"]))
    return jobs


def curve_jobs(args: argparse.Namespace) -> list[Job]:
    """Each seed at each max_staleness, evaluated every N versions; the order alternates."""
    jobs = []
    for i, seed in enumerate(args.seeds):
        for k in args.staleness if i % 2 == 0 else args.staleness[::-1]:
            jobs.append(
                (
                    f"k{k}-s{seed}",
                    [f"seed={seed}", f"eval.every={args.every}", f"trainer.max_staleness={k}"],
                )
            )
    return jobs


async def measure(args: argparse.Namespace, jobs: list[Job]) -> dict[str, dict[str, Any]]:
    """Train every job in turn against one fleet, sized for the largest max_staleness."""
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.training import run_training
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model

    out: Path = args.out
    model = make_tiny_model(out / "model", seed=0)
    widest = max([*args.staleness, 0]) if args.curve else None
    base = TrainingConfig.from_yaml(
        EXAMPLE,
        [
            f"model={model}",
            f"eval.every={args.every}",
            *([f"trainer.max_staleness={widest}"] if widest is not None else []),
        ],
    )
    fleet = dataclasses.replace(
        base.serve,
        log_dir=str(out / "fleet-logs"),
        transports=(str(out),),
        adapter_cache_dir=str(out / "fleet-adapters"),
    )
    print(f"starting {fleet.replicas} vLLM replicas (--max-loras {fleet.lora_slots})", flush=True)
    rows = {}
    async with launch_replicas(fleet) as replicas:
        urls = ",".join(r.url for r in replicas)
        for name, overrides in jobs:
            shutil.rmtree(out / "runs" / name, ignore_errors=True)
            cfg = TrainingConfig.from_yaml(
                EXAMPLE,
                [
                    f"model={model}",
                    f"output_dir={out / 'runs'}",
                    f"run_name={name}",
                    "serve.replicas=0",
                    f"proxy.upstreams=[{urls}]",
                    f"trainer.max_steps={args.steps}",
                    *overrides,
                ],
            )
            t0 = time.monotonic()
            result = await run_training(cfg)
            rows[name] = row = figures(result.run_dir, time.monotonic() - t0)
            print(f"{name}: {describe(row)}", flush=True)
    return rows


def describe(row: dict[str, Any]) -> str:
    secs = f"{row['secs']:.0f}" if row["secs"] is not None else "-"
    return (
        f"| {row['s_step']:.2f} | {row['steps_per_s']:.3f} | {row['step'] or '-'} | {secs} "
        f"| {row['evals']} | {row['held'][0]:.3f} -> {row['held'][1]:.3f} "
        f"| {row['wall']:.0f} |"
    )


def report(rows: dict[str, dict[str, Any]], every: int) -> None:
    print(
        "\n| eval.every | seed | s/step | steps/s | step>=0.5 | s to 0.5 | evals | held-out "
        "| wall s |\n|---|---|---|---|---|---|---|---|---|"
    )
    for name, row in rows.items():
        label, seed = name.split("-s")
        print(f"| {every if label == 'on' else 0} | {seed} {describe(row)}")
    by = {k: [r for name, r in rows.items() if name.startswith(k)] for k in ("off", "on")}
    speed = [statistics.fmean(r["steps_per_s"] for r in by[k]) for k in ("off", "on")]
    print(f"\nsteps/s on / off: {speed[1] / speed[0]:.3f}")
    secs = [[r["secs"] for r in by[k] if r["secs"] is not None] for k in ("off", "on")]
    if all(secs):
        mean = [statistics.fmean(s) for s in secs]
        print(f"time to reward {THRESHOLD} on / off: {mean[1] / mean[0]:.3f}")


def curves(rows: dict[str, dict[str, Any]], staleness: list[int], what: str) -> dict[int, Any]:
    """max_staleness -> {seed: {version: row[what]'s value}} of its runs."""
    by: dict[int, dict[int, dict[int, float]]] = {k: {} for k in staleness}
    for name, row in rows.items():
        k, seed = (int(part[1:]) for part in name.split("-"))
        if k in by:
            by[k][seed] = row[what]
    return by


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}, {max(values):.3f}] ({len(values)})"


def report_curve(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Held-out reward by version per max_staleness (mean over seeds [min, max] n) beside the
    training reward, then base -> final per run, then the plot."""
    held, train = (curves(rows, args.staleness, what) for what in ("curve", "train"))
    versions = sorted({v for seeds in held.values() for c in seeds.values() for v in c})
    head = " | ".join(
        f"max_staleness {k}: held-out mean [min, max] (seeds) | training reward"
        for k in args.staleness
    )
    print(f"\n| version | {head} |\n|---|" + "---|---|" * len(args.staleness))
    for v in versions:
        cells = []
        for k in args.staleness:
            cells.append(spread([c[v] for c in held[k].values() if v in c]))
            got = [c[v] for c in train[k].values() if v in c]
            cells.append(f"{statistics.fmean(got):.3f}" if got else "-")
        print(f"| {v} | " + " | ".join(cells) + " |")
    print(
        "\n| max_staleness | seed | held-out base -> final | evals during training "
        "| held-out - training reward | training reward, last 5 steps | step>=0.5 | s/step |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for k in args.staleness:
        for seed, name in sorted(
            (int(n.split("-s")[1]), n) for n in rows if n.startswith(f"k{k}-")
        ):
            row = rows[name]
            print(
                f"| {k} | {seed} | {row['held'][0]:.3f} -> {row['held'][1]:.3f} "
                f"| {row['evals']} | {row['gap']:+.3f} | {row['last5']:.3f} "
                f"| {row['step'] or '-'} | {row['s_step']:.2f} |"
            )
    for k in args.staleness:
        mine = [row for n, row in rows.items() if n.startswith(f"k{k}-")]
        if mine:
            print(
                f"max_staleness {k}: final held-out {spread([r['held'][1] for r in mine])}, "
                f"held-out - training reward {spread([r['gap'] for r in mine])}"
            )
    plot_curve(held, args.out / "curve.png")
    print(f"plot: {args.out / 'curve.png'}")


def plot_curve(by: dict[int, dict[str, Any]], path: Path) -> None:
    """Held-out reward against version: each max_staleness's mean over seeds thick, its seeds
    thin, in one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (k, seeds), colour in zip(
        by.items(), ("black", "tab:blue", "tab:red", "tab:green"), strict=False
    ):
        for c in seeds.values():
            ax.plot(list(c), list(c.values()), color=colour, linewidth=0.7, alpha=0.5, marker=".")
        versions = sorted({v for c in seeds.values() for v in c})
        mean = [statistics.fmean(c[v] for c in seeds.values() if v in c) for v in versions]
        ax.plot(
            versions,
            mean,
            color=colour,
            linewidth=2.2,
            marker="o",
            label=f"max_staleness {k}: mean of {len(seeds)} seeds (thin: each)",
        )
    ax.set_xlabel("adapter version evaluated")
    ax.set_ylabel("held-out eval/reward")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("held-out reward by version, demo recipe")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument("--every", type=int, default=5, help="eval.every of the evaluated runs")
    p.add_argument(
        "--seeds",
        type=ints,
        default=None,
        help="comma-separated seeds (default 0; with --curve 0,1,2)",
    )
    p.add_argument("--steps", type=int, default=40, help="trainer.max_steps")
    p.add_argument(
        "--curve",
        action="store_true",
        help="held-out reward by version at each --staleness, not the cost of eval",
    )
    p.add_argument(
        "--staleness", type=ints, default=[0, 4], help="with --curve: trainer.max_staleness values"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="with --curve: only the table and plot of the runs in --out",
    )
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.seeds = args.seeds or ([0, 1, 2] if args.curve else [0])
    if args.curve:
        args.out = args.out / "curve"
        jobs = curve_jobs(args)
        if not args.report:
            anyio.run(measure, args, jobs)
        from asyncgrpo.evaluation.records import EVAL_METRICS_FILE

        runs = [args.out / "runs" / name for name, _ in jobs]
        report_curve({r.name: figures(r) for r in runs if (r / EVAL_METRICS_FILE).is_file()}, args)
    else:
        report(anyio.run(measure, args, comparison(args)), args.every)


if __name__ == "__main__":
    main()

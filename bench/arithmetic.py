"""Asynchronous against synchronous GRPO on a task with held-out headroom: the arithmetic recipe
at several ``trainer.max_staleness`` values, several seeds each, held-out pass@1 against wall
time, and where each setting's time goes.

Every run is ``examples/arithmetic.yaml`` (the arithmetic test model of
``asyncgrpo.testing.arithmetic``, built once into the user's cache; two float32 vLLM replicas behind
the proxy; the exact-answer math reward; the held-out set evaluated every few versions) with
only ``seed`` and ``trainer.max_staleness`` changed, plus the overrides of a ``--recipe
NAME:KEY=VALUE,...`` when recipes are compared (each recipe runs the same grid). One fleet is
started once and every run trains against it in turn (``bench/staleness.py``'s
``train_on_one_fleet``); the order of the settings alternates by seed, so a drift of the
shared host's load hits them alike.

Results go to ``--out/results.jsonl``, one line per run; runs already there are skipped, so
the grid can be measured in chunks (``--max-minutes``: e.g. under a shared lock) and
``--report`` renders the tables and the plot from that file alone.

The clock of a run starts when its first optimizer step does (start-up and the base model's
evaluation excluded); a version's held-out pass@1 is placed at the time it was published.
Columns: ``base`` (the base model's pass@1), ``@T s`` (the newest evaluated version published
by then), ``end`` (the final version), ``t +20`` (seconds until a version scoring the base +
20 points was published; ``-`` never), ``s/step`` (mean) with its parts: ``wait`` (for
rollouts), ``train`` (the optimizer step), ``sync`` (publish, load, unload and the served-policy
audit), ``other`` (the rest: checkpoints, bookkeeping); ``G`` (seconds per step with a rollout
request in flight: ``rollout/busy_s``) and ``T`` (train + sync); ``stale`` (mean staleness of
the trained samples); ``dip`` (the most evaluations in a row more than 10 points below the
run's best so far: the stability bar is at most 2); ``audit`` (the largest mean |trainer -
vLLM| logprob of any audited replica and version; a run whose audit fails stops).

The overlap table: from the synchronous runs' G and T (generation and training never overlap
there), the best any overlap can do is ``(G + T) / max(G, T)`` times the synchronous speed;
beside it each asynchronous setting's measured speed-up (s/step, and time to +20 points, both
over the synchronous runs', medians over seeds) and its own G and T, which show what sharing
the cores cost: on one host, generation that overlaps training runs on fewer free cores.

Run: ``python bench/arithmetic.py`` (the grid: max_staleness 0, 1, 2, 4 x seeds 0-3),
``python bench/arithmetic.py --max-minutes 35`` (as much as fits; run again to continue),
``python bench/arithmetic.py --staleness 4 --seeds 0,1 --recipe recipe --recipe
lr1:trainer.learning_rate=1e-2`` (a default checked against another value),
``python bench/arithmetic.py --report`` (tables and plot of what is measured).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from staleness import (  # noqa: E402  (bench/)
    Job,
    add_sweep_args,
    parse_recipe,
    run_sweep,
    train_on_one_fleet,
)

EXAMPLE = ROOT / "examples" / "arithmetic.yaml"
OUT = ROOT / "runs" / "bench-arithmetic"
PLOT = ROOT / "docs" / "arithmetic.png"
BASE = "recipe"  # examples/arithmetic.yaml as it is
STALENESS = [0, 1, 2, 4]
SEEDS = [0, 1, 2, 3]
TIMES = [60, 120, 240]
GAIN = 0.20  # the target: the base model's pass@1 + 20 points
DIP, DIP_RUN = 0.10, 2  # stability: never more than 2 evaluations in a row 10 points below best


def key(recipe: str, k: int, seed: int) -> str:
    return f"{'' if recipe == BASE else f'{recipe}-'}k{k}-s{seed}"


def grid(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """Per seed, every recipe at every max_staleness, the order reversed on odd seeds."""
    out = []
    for i, seed in enumerate(args.seeds):
        cells = [(recipe, k, seed) for recipe in args.recipes for k in args.staleness]
        out += cells if i % 2 == 0 else cells[::-1]
    return out


# ---- one run's figures -------------------------------------------------------------------------
def summarize(run_dir: Path) -> dict[str, Any]:
    """A run's per-step series and its evaluations on the run's clock (see the docstring)."""
    from asyncgrpo.evaluation.records import read_evals
    from asyncgrpo.run.metrics import read_metrics

    records = read_metrics(run_dir)
    start = records[0]["time"] - records[0]["perf/step_s"]
    at = {int(r["step"]): r["time"] - start for r in records}

    def series(name: str) -> list[float]:
        return [float(r.get(name, 0.0) or 0.0) for r in records]

    evals = [
        {
            "version": int(e["eval/version"]),
            "t": at.get(int(e["step"]), 0.0),
            "pass1": float(e["eval/pass@1"]),
            "reward": float(e["eval/reward"]),
        }
        for e in read_evals(run_dir)
    ]
    audits = [r["audit/mean_abs_logprob_diff"] for r in records if "audit/tokens" in r]
    sync, audit = series("perf/weight_sync_s"), series("perf/audit_s")
    stale = [float(r.get("sample/staleness_mean", math.nan)) for r in records]
    return {
        "t": [at[int(r["step"])] for r in records],
        "reward": series("reward"),
        "step_s": series("perf/step_s"),
        "wait_s": series("perf/rollout_wait_s"),
        "train_s": series("perf/train_step_s"),
        "sync_s": [a + b for a, b in zip(sync, audit, strict=True)],
        "busy_s": series("rollout/busy_s"),
        "stale": [v for v in stale if not math.isnan(v)],
        "evals": evals,
        "audits": len(audits),
        "audit_max": max(audits, default=math.nan),
    }


def figures(row: dict[str, Any], times: list[float]) -> dict[str, Any]:
    evals = row["evals"]
    base = evals[0]["pass1"]
    target = next((e["t"] for e in evals if e["pass1"] >= base + GAIN - 1e-9), None)

    def by(t: float) -> float:
        return [e["pass1"] for e in evals if e["t"] <= t][-1]

    best, run, dip = -1.0, 0, 0
    for e in evals:
        best = max(best, e["pass1"])
        run = run + 1 if e["pass1"] < best - DIP - 1e-9 else 0
        dip = max(dip, run)
    n = len(row["step_s"])
    mean = lambda xs: sum(xs) / n  # noqa: E731
    step, wait, train, sync = (mean(row[k]) for k in ("step_s", "wait_s", "train_s", "sync_s"))
    return {
        "base": base,
        "at": [by(t) for t in times],
        "end": evals[-1]["pass1"],
        "best": max(e["pass1"] for e in evals),
        "target": target,
        "s_step": step,
        "wait": wait,
        "train": train,
        "sync": sync,
        "other": step - wait - train - sync,
        "G": mean(row["busy_s"]),
        "T": train + sync,
        "stale": statistics.fmean(row["stale"]) if row["stale"] else math.nan,
        "dip": dip,
        "evals": len(evals),
        "steps": n,
    }


# ---- measuring ---------------------------------------------------------------------------------
def build_model(given: Path | None = None) -> Path:
    """``given`` (a directory ``python -m asyncgrpo.testing.arithmetic`` wrote), else the
    cached build (made here if missing: minutes)."""
    from asyncgrpo.testing.arithmetic import cached_arithmetic_model
    from asyncgrpo.testing.model_cache import default_cache_root

    model = given or cached_arithmetic_model(default_cache_root())
    build = json.loads((model / "build.json").read_text())
    print(
        f"model {model}: held-out greedy {build['heldout_greedy']['all']:.3f}, "
        f"pass@1 at temperature 1 {build['heldout_t1']['all']:.3f}",
        flush=True,
    )
    return model


async def measure(args: argparse.Namespace, todo: list[tuple[str, int, int]]) -> None:
    model = build_model(args.model)
    data = [f"dataset.path={model / 'train.jsonl'}", f"eval.path={model / 'heldout.jsonl'}"]
    jobs: list[Job] = [
        (
            key(recipe, k, seed),
            [
                *data,
                f"seed={seed}",
                f"trainer.max_staleness={k}",
                *([f"trainer.max_steps={args.steps}"] if args.steps else []),
                *args.overrides[recipe],
            ],
        )
        for recipe, k, seed in todo
    ]
    cells = {key(*c): c for c in todo}

    def done(name: str, run_dir: Path, wall: float, load_avg: list[float]) -> None:
        recipe, k, seed = cells[name]
        row = summarize(run_dir)
        row.update(
            key=name,
            recipe=recipe,
            overrides=list(args.overrides[recipe]),
            staleness=k,
            seed=seed,
            wall_s=wall,
            load=load_avg,
            time=time.time(),
            commit=args.commit,
        )
        with (args.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        f_ = figures(row, args.times)
        print(
            f"{name:<16} pass@1 {f_['base']:.3f} -> {f_['end']:.3f} (best {f_['best']:.3f})  "
            f"t +20 {fmt_s(f_['target'])}  {f_['s_step']:.2f} s/step (wait {f_['wait']:.2f}, "
            f"train {f_['train']:.2f}, sync {f_['sync']:.2f}; G {f_['G']:.2f})  stale "
            f"{f_['stale']:.2f}  dip {f_['dip']}  audit {row['audits']} x <= "
            f"{row['audit_max']:.1e}  wall {wall:.0f} s",
            flush=True,
        )

    widest = max(k for _, k, _ in todo)
    await train_on_one_fleet(
        EXAMPLE,
        model,
        args.out,
        jobs,
        max_minutes=args.max_minutes,
        fleet_overrides=[*data, f"trainer.max_staleness={widest}"],
        done=done,
    )


# ---- report ------------------------------------------------------------------------------------
def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def med(values: list[float | None]) -> float | None:
    """Median, a missing value (never reached) counting as infinite; None if that is it."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    times = args.times
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in sorted(
        rows.values(), key=lambda r: (args.recipes.index(r["recipe"]), r["staleness"], r["seed"])
    ):
        groups.setdefault((row["recipe"], row["staleness"]), []).append(row)
    at = " | ".join(f"@{t:g} s" for t in times)
    print(
        f"\nheld-out pass@1 (temperature 1) and time per step, per run\n\n| recipe | "
        f"max_staleness | seed | base | {at} | end | t +20 [s] | s/step | wait | train | sync "
        f"| other | G | T | stale | dip | audit max |\n" + "|---" * (17 + len(times)) + "|"
    )
    for (recipe, k), members in groups.items():
        for row in members:
            f = figures(row, times)
            cells = " | ".join(f"{v:.3f}" for v in f["at"])
            print(
                f"| {recipe} | {k} | {row['seed']} | {f['base']:.3f} | {cells} | "
                f"{f['end']:.3f} | {fmt_s(f['target'])} | {f['s_step']:.2f} | {f['wait']:.2f} "
                f"| {f['train']:.2f} | {f['sync']:.2f} | {f['other']:.2f} | {f['G']:.2f} | "
                f"{f['T']:.2f} | {f['stale']:.2f} | {f['dip']} | {row['audit_max']:.1e} |"
            )
    print(
        f"\nmedians over seeds\n\n| recipe | max_staleness | seeds | base | {at} | end | "
        f"end - base (min) | t +20 [s] (reached) | s/step | wait | train | sync | G | T | "
        f"stale | dip max |\n" + "|---" * (16 + len(times)) + "|"
    )
    for (recipe, k), members in groups.items():
        fs = [figures(r, times) for r in members]

        def m(name: str, fs: list[dict[str, Any]] = fs) -> float:
            return statistics.median(f[name] for f in fs)

        cells = " | ".join(
            f"{statistics.median(f['at'][i] for f in fs):.3f}" for i in range(len(times))
        )
        gain = min(f["end"] - f["base"] for f in fs)
        reached = sum(f["target"] is not None for f in fs)
        print(
            f"| {recipe} | {k} | {len(fs)} | {m('base'):.3f} | {cells} | {m('end'):.3f} | "
            f"{gain:+.3f} | {fmt_s(med([f['target'] for f in fs]))} ({reached}/{len(fs)}) | "
            f"{m('s_step'):.2f} | {m('wait'):.2f} | {m('train'):.2f} | {m('sync'):.2f} | "
            f"{m('G'):.2f} | {m('T'):.2f} | {m('stale'):.2f} | {max(f['dip'] for f in fs)} |"
        )
    overlap(groups, times)
    if rows:
        plot(groups, args)
        print(f"\nplot: {args.plot}")


def overlap(groups: dict[tuple[str, int], list[dict[str, Any]]], times: list[float]) -> None:
    """Per recipe: the overlap limit from its synchronous runs beside each async setting's
    measured speed-up."""
    for (recipe, k), members in groups.items():
        sync = groups.get((recipe, 0))
        if k == 0 or not sync:
            continue
        s = [figures(r, times) for r in sync]
        a = [figures(r, times) for r in members]
        g, t = (statistics.median(f[x] for f in s) for x in ("G", "T"))
        limit = (g + t) / max(g, t)
        speed = statistics.median(f["s_step"] for f in s) / statistics.median(
            f["s_step"] for f in a
        )
        ts, ta = med([f["target"] for f in s]), med([f["target"] for f in a])
        to_target = f"{ts / ta:.2f}x" if ts and ta else "-"
        ga, ta_ = (statistics.median(f[x] for f in a) for x in ("G", "T"))
        print(
            f"\n{recipe} max_staleness {k}: overlap limit (G + T) / max(G, T) = ({g:.2f} + "
            f"{t:.2f}) / {max(g, t):.2f} = {limit:.2f}x (synchronous G, T); measured "
            f"{speed:.2f}x per step, {to_target} to +20 points; overlapped, G {ga:.2f} s "
            f"({ga / g:.2f}x its synchronous value) and T {ta_:.2f} s ({ta_ / t:.2f}x), "
            f"wait {statistics.median(f['wait'] for f in a):.2f} s per step"
        )


def plot(groups: dict[tuple[str, int], list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Held-out pass@1 against the run's clock: per setting the median over seeds (of each
    seed's newest evaluated version by then), shaded between the lowest and highest seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recipes = list(dict.fromkeys(r for r, _ in groups))
    fig, axes = plt.subplots(1, len(recipes), figsize=(7 * len(recipes), 4.2), squeeze=False)
    colours = {0: "black", 1: "tab:green", 2: "tab:blue", 4: "tab:red"}
    for ax, recipe in zip(axes[0], recipes, strict=True):
        for (rk, k), members in groups.items():
            if rk != recipe:
                continue
            end = min(r["evals"][-1]["t"] for r in members)
            grid_ = [end * i / 200 for i in range(201)]
            curves = [
                [[e["pass1"] for e in r["evals"] if e["t"] <= t][-1] for t in grid_]
                for r in members
            ]
            mid = [statistics.median(c[i] for c in curves) for i in range(len(grid_))]
            lo = [min(c[i] for c in curves) for i in range(len(grid_))]
            hi = [max(c[i] for c in curves) for i in range(len(grid_))]
            colour = colours.get(k, "grey")
            label = f"max_staleness {k}{' (sync)' if k == 0 else ''} ({len(members)} seeds)"
            ax.plot(
                grid_,
                mid,
                color=colour,
                linewidth=1.5,
                label=label,
                linestyle="--" if k == 0 else "-",
            )
            ax.fill_between(grid_, lo, hi, color=colour, alpha=0.12, step=None)
        base = statistics.median(
            r["evals"][0]["pass1"] for (rk, _), m in groups.items() if rk == recipe for r in m
        )
        ax.axhline(
            base + GAIN,
            color="grey",
            linewidth=0.8,
            linestyle=":",
            label=f"base + {GAIN * 100:.0f} points",
        )
        ax.set_title(f"{recipe}: held-out pass@1 by wall time (median, min-max over seeds)")
        ax.set_xlabel("seconds since the first optimizer step")
        ax.set_ylabel("held-out pass@1, temperature 1")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument("--staleness", type=ints, default=STALENESS, help="max_staleness values")
    p.add_argument("--seeds", type=ints, default=SEEDS, help="training seeds")
    p.add_argument(
        "--recipe",
        type=lambda v: parse_recipe(v, BASE),
        action="append",
        dest="recipes",
        help=f"'{BASE}' (examples/arithmetic.yaml as it is; the default) or "
        "NAME:KEY=VALUE[,KEY=VALUE]: the recipe with these overrides, for every "
        "max_staleness and seed alike; repeat to compare",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: recipe's)")
    p.add_argument(
        "--times",
        type=lambda v: [float(x) for x in v.split(",")],
        default=TIMES,
        help="wall times (s since the first step) for the table's columns",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="an arithmetic model directory already built (default: the cached build in "
        "~/.cache/asyncgrpo/test-models, made first if missing)",
    )
    add_sweep_args(p, OUT, PLOT)
    run_sweep(p, BASE, grid=grid, key=key, measure=measure, report=report)


if __name__ == "__main__":
    main()

"""Learning curves by staleness: the demo recipe at several ``trainer.max_staleness`` values and
off-policy corrections, several seeds each, reward against optimizer step and wall clock.

Every run is ``examples/tiny_cpu.yaml`` (the ``asyncgrpo demo`` recipe: the tiny model, two
float32 vLLM replicas behind the proxy, 32 samples per step, a sync every step, 40 steps) with
only ``seed``, ``trainer.max_staleness`` and ``trainer.off_policy`` changed, plus the config
overrides of a ``--recipe NAME:KEY=VALUE,...`` (e.g. ``lr25:trainer.learning_rate=2.5e-2``) when
recipes are compared: each recipe runs the same grid, gets its own table, verdict and plot.
One fleet of replicas is started once and every run trains against it in turn (``serve.replicas
=0``, ``proxy.upstreams``), each run under its own name and store.

At ``max_staleness`` 0 the corrections are one objective (every sample comes from the trainer's
current weights, so the importance weight is vLLM's numerics, |w - 1| < 1e-3: see
``tests/trainer/test_loss.py::test_on_fresh_tokens_the_corrections_coincide``), so it runs once
per seed, with the default correction, as the synchronous baseline of every correction.

Results go to ``--out/results.jsonl``, one line per run, and runs already there are skipped, so
the grid can be measured in chunks (``--max-minutes``; e.g. under a shared lock) and
``--report`` renders the table and the plot from that file alone. The columns: ``last-5``
(mean reward of the last 5 steps), ``step>=0.5`` (first step whose 3-step mean reward reaches
0.5; ``-`` never), ``s to 0.5`` (training wall time until then: the sum of its steps, startup
excluded), ``s/step`` (median step), ``stale`` (mean staleness of the trained samples, versions),
``w max`` (largest importance weight pi_trainer / pi_vllm seen), ``cut`` (share of tokens the
cap masked or truncated, over the run).

Run: ``python bench/staleness.py`` (the whole grid, about 30 min on 2 quiet cores),
``python bench/staleness.py --max-minutes 10`` (as much as fits; run again to continue),
``python bench/staleness.py --staleness 4 --corrections decoupled --seeds 0`` (one run),
``python bench/staleness.py --staleness 0,4 --corrections decoupled --recipe demo --recipe
lr25:trainer.learning_rate=2.5e-2`` (the demo's recipe against another learning rate),
``python bench/staleness.py --report`` (table and plot of what is measured).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
OUT = ROOT / "runs" / "bench-staleness"
PLOT = ROOT / "docs" / "staleness.png"
STALENESS = [0, 1, 2, 4]
CORRECTIONS = ["none", "decoupled", "tis"]
SEEDS = [0, 1, 2]
THRESHOLD, WINDOW, LAST = 0.5, 3, 5
CURVES = {  # per-step figures kept in results.jsonl: the collapse figures of docs/trainer.md
    "entropy": "entropy",
    "kl": "kl",
    "w_max": "off_policy/weight_max",
    "grad_norm": "grad_norm",
    "update_norm": "collapse/update_norm",
    "adv_abs_max": "advantages/abs_max",
    "adv_abs_mean": "advantages/abs_mean",
    "alarm": "collapse/alarm",
}
KEEP, KEPT_BAR = 0.9, 0.8  # reach a 3-step mean of 0.9, never fall below 0.8 after
SYNC = "any"  # the correction label of max_staleness 0 (all coincide there)


DEMO = "demo"  # the recipe of examples/tiny_cpu.yaml as it is


def key(recipe: str, k: int, correction: str, seed: int) -> str:
    prefix = "" if recipe == DEMO else f"{recipe}-"
    return f"{prefix}k{k}-{correction.replace('@', '-cap')}-s{seed}"


def parse_recipe(text: str, base: str = DEMO) -> tuple[str, tuple[str, ...]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` (config overrides on top of the example's) or ``base`` (the
    example as it is)."""
    name, _, overrides = text.partition(":")
    pairs = tuple(o for o in overrides.split(",") if o)
    if not name.replace("_", "").isalnum() or (name == base) == bool(pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: give {base!r} or NAME:KEY=VALUE[,KEY=VALUE]")
    if any("=" not in o for o in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: every override is KEY=VALUE")
    return name, pairs


def grid(args: argparse.Namespace) -> list[tuple[str, int, str, int]]:
    out = []
    for recipe in args.recipes:
        for k in args.staleness:
            for correction in [SYNC] if k == 0 else args.corrections:
                out += [(recipe, k, correction, seed) for seed in args.seeds]
    return out


def load(path: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["key"]] = row  # a rerun replaces an earlier line
    return rows


# ---- measuring ---------------------------------------------------------------------------------
Job = tuple[str, list[str]]  # run name, config overrides on top of the example's


async def train_on_one_fleet(
    example: Path,
    model: Path,
    out: Path,
    jobs: list[Job],
    *,
    fleet_overrides: list[str],
    max_minutes: float | None,
    done: Callable[[str, Path, float, list[float]], None],
) -> None:
    """Train each job of ``jobs`` in turn (``example`` with its overrides, ``model``, under
    ``out/runs/NAME``, a fresh start) against one fleet of replicas started once from
    ``example`` with ``fleet_overrides`` (size its LoRA slots: the widest max_staleness, the
    eval section's pinned version); ``done(name, run_dir, wall_s, [load before, after])`` after
    each. Starts no run after ``max_minutes``. Shared by the benches that compare recipes on
    the same replicas (this one, ``bench/arithmetic.py``)."""
    import dataclasses

    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.training import run_training
    from asyncgrpo.serve import launch_replicas

    base = TrainingConfig.from_yaml(example, [f"model={model}", *fleet_overrides])
    fleet = dataclasses.replace(
        base.serve,
        log_dir=str(out / "fleet-logs"),
        transports=(str(out),),
        adapter_cache_dir=str(out / "fleet-adapters"),
    )
    started = time.monotonic()
    print(f"starting {fleet.replicas} vLLM replicas (--max-loras {fleet.lora_slots})", flush=True)
    async with launch_replicas(fleet) as replicas:
        urls = [r.url for r in replicas]
        print(f"fleet up after {time.monotonic() - started:.0f} s: {', '.join(urls)}", flush=True)
        for name, overrides in jobs:
            spent = (time.monotonic() - started) / 60
            if max_minutes is not None and spent > max_minutes:
                print(f"--max-minutes {max_minutes:g} reached; run again to continue")
                return
            run_dir = out / "runs" / name
            if run_dir.exists():  # an interrupted attempt: start fresh, never resume it
                shutil.rmtree(run_dir)
            cfg = TrainingConfig.from_yaml(
                example,
                [
                    f"model={model}",
                    f"output_dir={out / 'runs'}",
                    f"run_name={name}",
                    "serve.replicas=0",
                    f"proxy.upstreams=[{','.join(urls)}]",
                    *overrides,
                ],
            )
            load_start = os.getloadavg()[0]
            t0 = time.monotonic()
            result = await run_training(cfg)
            done(name, result.run_dir, time.monotonic() - t0, [load_start, os.getloadavg()[0]])


async def measure(args: argparse.Namespace, todo: list[tuple[str, int, str, int]]) -> None:
    from asyncgrpo.run.metrics import read_metrics
    from asyncgrpo.testing import make_tiny_model

    out: Path = args.out
    model = make_tiny_model(out / "model", seed=0)  # the demo's model
    jobs: list[Job] = []
    for recipe, k, correction, seed in todo:
        off_policy, _, cap = correction.partition("@")
        jobs.append(
            (
                key(recipe, k, correction, seed),
                [
                    f"seed={seed}",
                    f"trainer.max_staleness={k}",
                    f"trainer.off_policy={'decoupled' if correction == SYNC else off_policy}",
                    *([f"trainer.importance_cap={cap}"] if cap else []),
                    *([f"trainer.max_steps={args.steps}"] if args.steps else []),
                    *args.overrides[recipe],
                ],
            )
        )
    cells = {key(*c): c for c in todo}

    def done(name: str, run_dir: Path, wall: float, load: list[float]) -> None:
        recipe, k, correction, seed = cells[name]
        row = summarize(read_metrics(run_dir))
        row.update(
            key=name,
            recipe=recipe,
            overrides=list(args.overrides[recipe]),
            staleness=k,
            correction=correction,
            seed=seed,
            wall_s=wall,
            load=load,
            time=time.time(),
            commit=args.commit,
        )
        with (out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(line(row), flush=True)

    widest = max(k for _, k, _, _ in todo)
    await train_on_one_fleet(
        EXAMPLE,
        model,
        out,
        jobs,
        max_minutes=args.max_minutes,
        fleet_overrides=[f"trainer.max_staleness={widest}"],
        done=done,
    )


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's curves and figures from its metrics records."""

    def series(name: str) -> list[float]:
        return [float(r.get(name, math.nan)) for r in records]

    def total(name: str) -> float:
        return sum(v for v in series(name) if not math.isnan(v))

    ratios = [v for v in series("ratio") if not math.isnan(v)]
    tokens = series("batch/completion_tokens")
    cut = sum(
        (r.get("off_policy/masked", 0) + r.get("off_policy/truncated", 0)) * n
        for r, n in zip(records, tokens, strict=True)
    )
    return {
        "reward": series("reward"),
        "step_s": series("perf/step_s"),
        # per step, for the collapse figures of docs/trainer.md
        "curves": {name: series(metric) for name, metric in CURVES.items()},
        "stale_mean": series("sample/staleness_mean"),
        "weight_max": max(
            (v for v in series("off_policy/weight_max") if not math.isnan(v)), default=math.nan
        ),
        "cut": cut / total("batch/completion_tokens"),
        "ratio_min": min(ratios, default=math.nan),
        "ratio_max": max(ratios, default=math.nan),
        "ratio_steps": len(ratios),
        "dropped": float(records[-1].get("sample/dropped_stale_total", 0.0)),
    }


def reached(rewards: list[float], threshold: float = THRESHOLD) -> int | None:
    """1-based step at which the WINDOW-step mean reward first reaches ``threshold``."""
    for k in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[k - WINDOW : k]) >= threshold:
            return k
    return None


def kept(rewards: list[float]) -> float | None:
    """After the WINDOW-step mean first reaches KEEP, the lowest WINDOW-step mean from there
    on (None: it never reached KEEP). A run that keeps what it learned stays near KEEP."""
    at = reached(rewards, KEEP)
    if at is None:
        return None
    return min(statistics.fmean(rewards[k - WINDOW : k]) for k in range(at, len(rewards) + 1))


def figures(row: dict[str, Any]) -> dict[str, Any]:
    r = row["reward"]
    step = reached(r)
    return {
        "last": statistics.fmean(r[-LAST:]),
        "first": statistics.fmean(r[:LAST]),
        "step": step,
        "secs": sum(row["step_s"][:step]) if step else None,
        "step90": reached(r, KEEP),
        "kept": kept(r),
        "s_step": statistics.median(row["step_s"]),
        "stale": statistics.fmean(v for v in row["stale_mean"] if not math.isnan(v)),
    }


def wfmt(w: float) -> str:
    """A weight: near 1 to 1e-7 (vLLM's numerics show), far from it to 3 digits."""
    return f"{w:.7f}" if abs(w - 1) < 1e-3 else f"{w:.3g}"


def line(row: dict[str, Any]) -> str:
    f = figures(row)
    return (
        f"{row['key']:<18} reward {f['first']:.3f} -> {f['last']:.3f}  step>=0.5 "
        f"{f['step'] or '-':>3}  {f['s_step']:.2f} s/step  stale {f['stale']:.2f}  "
        f"w max {wfmt(row['weight_max'])}  ratio [{row['ratio_min']:.6f}, "
        f"{row['ratio_max']:.6f}] on {row['ratio_steps']} steps  wall {row['wall_s']:.0f} s"
    )


# ---- report ------------------------------------------------------------------------------------
def report(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """One table, summary, verdict and plot per recipe (``--plot`` for the demo's own, with the
    recipe's name appended for the others)."""
    for recipe in args.recipes:
        mine = {k: r for k, r in rows.items() if r.get("recipe", DEMO) == recipe}
        overrides = " ".join(args.overrides[recipe]) or str(EXAMPLE.relative_to(ROOT))
        print(f"\nrecipe {recipe}: {overrides}")
        path = args.plot if recipe == DEMO else args.plot.with_stem(f"{args.plot.stem}-{recipe}")
        report_recipe(mine, path)
    compare(rows, args)


def report_recipe(rows: dict[str, dict[str, Any]], path: Path) -> None:
    order = {c: i for i, c in enumerate([SYNC, *CORRECTIONS])}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in sorted(
        rows.values(), key=lambda r: (r["staleness"], order.get(r["correction"], 9), r["seed"])
    ):
        groups.setdefault((row["staleness"], row["correction"]), []).append(row)
    print(
        "\n| max_staleness | correction | seed | reward first 5 -> last 5 | step>=0.5 | "
        "s to 0.5 | step>=0.9 | kept | s/step | stale | w max | cut |"
    )
    print("|---" * 12 + "|")
    for (k, correction), members in groups.items():
        for row in members:
            f = figures(row)
            secs = f"{f['secs']:.0f}" if f["secs"] else "-"
            kept_ = f"{f['kept']:.3f}" if f["kept"] is not None else "-"
            print(
                f"| {k} | {correction} | {row['seed']} | {f['first']:.3f} -> {f['last']:.3f} | "
                f"{f['step'] or 'never'} | {secs} | {f['step90'] or 'never'} | {kept_} | "
                f"{f['s_step']:.2f} | {f['stale']:.2f} | {wfmt(row['weight_max'])} | "
                f"{row['cut']:.4f} |"
            )
    print()
    for (k, correction), members in groups.items():
        fs = [figures(r) for r in members]
        print(f"max_staleness {k} {correction:<9} {stability(fs)}")
    verdict(groups)
    if rows:
        plot(groups, path)
        print(f"\nplot: {path}")


def stability(fs: list[dict[str, Any]]) -> str:
    """The bar over a group of runs: every run reaches a 3-step mean of KEEP and none
    falls below KEPT_BAR after it; with the median time to THRESHOLD beside it."""
    steps = [f["step"] or math.inf for f in fs]
    secs = [f["secs"] if f["secs"] is not None else math.inf for f in fs]
    reach = sum(f["step90"] is not None for f in fs)
    keep = sum(f["kept"] is not None and f["kept"] >= KEPT_BAR for f in fs)
    ok = "yes" if keep == len(fs) else "no"
    return (
        f"{len(fs)} seeds: reached {KEEP:g} {reach} of {len(fs)}, kept >= {KEPT_BAR:g} "
        f"{keep} of {len(fs)} ({ok}); lowest kept "
        f"{min((f['kept'] for f in fs if f['kept'] is not None), default=math.nan):.3f}; "
        f"last-5 min {min(f['last'] for f in fs):.3f}; median step>=0.5 "
        f"{statistics.median(steps):g}, median s to 0.5 {statistics.median(secs):.1f}"
    )


def compare(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """Each recipe's median time to THRESHOLD against ``--baseline``'s, per max_staleness."""
    base = args.baseline
    if base is None or base not in args.recipes:
        return
    print(f"\ntime to {THRESHOLD:g} against recipe {base} (median over seeds; the bar: 1.25x)")
    per: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows.values():
        per.setdefault((row.get("recipe", DEMO), row["staleness"]), []).append(figures(row))
    for (recipe, k), fs in sorted(per.items()):
        ref = per.get((base, k))
        if recipe == base or not ref:
            continue
        for what, unit in (("step", "steps"), ("secs", "s")):
            mine = statistics.median(f[what] or math.inf for f in fs)
            theirs = statistics.median(f[what] or math.inf for f in ref)
            print(
                f"  {recipe} max_staleness {k}: median {mine:.1f} {unit} vs {theirs:.1f} = "
                f"{mine / theirs:.2f}x ({len(fs)} vs {len(ref)} seeds)"
            )


def verdict(groups: dict[tuple[int, str], list[dict[str, Any]]]) -> None:
    """The issue's bar: at max_staleness 4 with the default correction, every seed's last-5
    reward >= 0.9 and the median first step with a 3-step mean >= 0.5 within 1.25x of the
    synchronous run's, over the same seeds: for all seeds, and for each block of 3 seeds."""
    sync, target = groups.get((0, SYNC)), groups.get((4, "decoupled"))
    if not sync or not target:
        return
    by_seed = {r["seed"]: r for r in sync}
    common = sorted(r["seed"] for r in target if r["seed"] in by_seed)
    blocks = [common[i : i + 3] for i in range(0, len(common), 3)] if len(common) > 3 else []
    print()
    for seeds in [common, *blocks]:
        s = [figures(by_seed[k]) for k in seeds]
        t = [figures(r) for r in target if r["seed"] in seeds]
        med_s = statistics.median(f["step"] or math.inf for f in s)
        med_t = statistics.median(f["step"] or math.inf for f in t)
        ok_last = all(f["last"] >= 0.9 for f in t)
        print(
            f"max_staleness 4, decoupled, seeds {seeds}: every last-5 reward >= 0.9: "
            f"{'yes' if ok_last else 'no'} (synchronous: "
            f"{sum(f['last'] >= 0.9 for f in s)} of {len(s)}); median step>=0.5 {med_t:g} vs "
            f"synchronous {med_s:g} = {med_t / med_s:.2f}x "
            f"({'<=' if med_t / med_s <= 1.25 else '>'} 1.25x)"
        )


def plot(groups: dict[tuple[int, str], list[dict[str, Any]]], path: Path) -> None:
    """Median reward over seeds (min-max shaded) against step and against training time, one
    row per max_staleness > 0, each with the synchronous run for reference. The median, not the
    mean: one seed that collapses late would drag a mean down for every step after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({k for k, _ in groups if k > 0})
    fig, axes = plt.subplots(max(1, len(ks)), 2, figsize=(11, 3.2 * max(1, len(ks))), squeeze=False)
    colours = {SYNC: "black", "none": "tab:red", "decoupled": "tab:blue", "tis": "tab:green"}
    for row_axes, k in zip(axes, ks or [0], strict=True):
        for (gk, correction), members in groups.items():
            if gk not in (0, k):
                continue
            label = "max_staleness 0" if gk == 0 else correction
            style = "--" if gk == 0 else "-"
            n = min(len(r["reward"]) for r in members)
            curves = [r["reward"][:n] for r in members]
            middle = [statistics.median(c[i] for c in curves) for i in range(n)]
            lo = [min(c[i] for c in curves) for i in range(n)]
            hi = [max(c[i] for c in curves) for i in range(n)]
            steps = list(range(1, n + 1))
            clock = [
                statistics.median(sum(r["step_s"][: i + 1]) for r in members) for i in range(n)
            ]
            for ax, xs in zip(row_axes, (steps, clock), strict=True):
                ax.plot(
                    xs,
                    middle,
                    style,
                    color=colours.get(correction, "grey"),
                    linewidth=1.3,
                    label=f"{label} ({len(members)} seeds)",
                )
                ax.fill_between(xs, lo, hi, color=colours.get(correction, "grey"), alpha=0.12)
        row_axes[0].set_title(f"max_staleness {k}: reward by step (median, min-max)")
        row_axes[1].set_title(f"max_staleness {k}: reward by training time")
        row_axes[0].set_xlabel("optimizer step")
        row_axes[1].set_xlabel("training wall clock [s] (sum of step times)")
        for ax in row_axes:
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument("--staleness", type=ints, default=STALENESS, help="max_staleness values")
    p.add_argument(
        "--corrections",
        type=lambda v: v.split(","),
        default=CORRECTIONS,
        help="trainer.off_policy values, NAME@CAP for another importance_cap "
        "(max_staleness 0 runs once for all)",
    )
    p.add_argument("--seeds", type=ints, default=SEEDS, help="training seeds")
    p.add_argument(
        "--recipe",
        type=parse_recipe,
        action="append",
        dest="recipes",
        help="'demo' (examples/tiny_cpu.yaml as it is; the default) or "
        "NAME:KEY=VALUE[,KEY=VALUE]: the demo's recipe with these config "
        "overrides, for every max_staleness and seed alike; repeat to compare "
        "recipes in one run",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="a recipe name: compare every other recipe's time to 0.5 with it",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's)")
    add_sweep_args(p, OUT, PLOT)
    run_sweep(p, DEMO, grid=grid, key=key, measure=measure, report=report)


def add_sweep_args(p: argparse.ArgumentParser, out: Path, plot: Path) -> None:
    """The options every sweep bench (this one, bench/arithmetic.py) shares."""
    p.add_argument("--out", type=Path, default=out, help="results.jsonl, run directories")
    p.add_argument("--plot", type=Path, default=plot, help="where the PNG goes")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no run after this many minutes (continue later)",
    )
    p.add_argument("--rerun", action="store_true", help="measure runs already in results.jsonl")
    p.add_argument("--report", action="store_true", help="only print the tables and the plot")


def run_sweep(
    p: argparse.ArgumentParser,
    base: str,
    *,
    grid: Callable[[argparse.Namespace], list[tuple[Any, ...]]],
    key: Callable[..., str],
    measure: Callable[..., Any],
    report: Callable[[dict[str, dict[str, Any]], argparse.Namespace], None],
) -> None:
    """A sweep bench's main after its options: measure the grid's runs missing from
    ``--out``/results.jsonl (all of them with ``--rerun``), then report the grid's rows."""
    args = p.parse_args()
    recipes = args.recipes or [(base, ())]
    args.overrides = dict(recipes)
    if len(args.overrides) < len(recipes):
        p.error("--recipe: each NAME once")
    args.recipes = list(args.overrides)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out = args.out.resolve()
    args.commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if not args.report:
        done = load(results)
        todo = [c for c in grid(args) if args.rerun or key(*c) not in done]
        print(
            f"{len(todo)} runs to measure ({len(done)} in {results}); "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
            flush=True,
        )
        if todo:
            import anyio

            anyio.run(measure, args, todo)
    rows = load(results)
    wanted = {key(*c) for c in grid(args)}
    report({k: v for k, v in rows.items() if k in wanted}, args)


if __name__ == "__main__":
    main()

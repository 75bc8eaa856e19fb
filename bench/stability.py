"""Does learning stay learned? The synthetic staleness simulation over a long horizon, several
recipes side by side (no vLLM: ``tests/trainer/staleness_sim.py``).

Every step samples from the adapter as it was ``--staleness`` optimizer steps earlier, with
that policy's exact logprobs, rewards the share of "digit" tokens (continuous, as the demo's
``digit_fraction``) and takes one ``Trainer.step``; the recipe is the demo's optimisation
settings (``examples/tiny_cpu.yaml``: lr, advantage scaling, Adam, clipping, correction) with a
recipe's overrides on top. Deterministic for a seed (CPU, one thread), so recipes differ only
in what they change. ``bench/staleness.py`` measures the same columns on the real fleet.

Columns: ``step>=0.5`` and ``step>=0.9`` (first step whose 3-step mean reward reaches it),
``kept`` (after the 3-step mean first reaches 0.9, its lowest value from there on: a run that
keeps what it learned stays near 0.9 or above), ``last-5``, ``entropy max`` (after step
``steps / 2``), ``update max`` (the largest ``collapse/update_norm`` after reaching 0.9).

The summary table adds, per recipe, the median and lowest ``last-5`` over the seeds.

Run: ``python bench/stability.py --recipe main:max_update_kl=null --recipe demo --jobs 2``
(the demo recipe without and with its trust region; 8 seeds, 100 steps, staleness 4; ``--jobs``
runs that many seeds at once, each on one thread, so the figures do not depend on it); results
go to ``--out/results.jsonl``, runs already there are skipped; ``--report`` prints the tables
from that file alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench-stability"
WINDOW, KEEP, KEPT_BAR = 3, 0.9, 0.8


def parse_recipe(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME:FIELD=VALUE,...`` (TrainerConfig fields, YAML values) or ``demo``."""
    import yaml

    name, _, rest = text.partition(":")
    pairs = [p for p in rest.split(",") if p]
    if not name.replace("_", "").isalnum() or any("=" not in p for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: give demo or NAME:FIELD=VALUE[,FIELD=VALUE]")
    return name, {
        k.removeprefix("trainer."): yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)
    }


def means(rewards: list[float]) -> list[float]:
    return [statistics.fmean(rewards[k - WINDOW : k]) for k in range(WINDOW, len(rewards) + 1)]


def reached(rewards: list[float], level: float) -> int | None:
    """1-based step whose WINDOW-step mean first reaches ``level``."""
    return next((i + WINDOW for i, m in enumerate(means(rewards)) if m >= level), None)


def kept(rewards: list[float]) -> float | None:
    at = reached(rewards, KEEP)
    return None if at is None else min(means(rewards)[at - WINDOW :])


def run_one(model: Path, recipe: dict[str, Any], staleness: int, steps: int, seed: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "trainer"))
    from staleness_sim import demo_recipe, simulate

    settings = demo_recipe() | recipe
    records: list[dict[str, float]] = []
    t0 = time.monotonic()
    rewards = simulate(
        model, staleness=staleness, steps=steps, seed=seed, records=records, **settings
    )
    curves = {
        name: [float(r.get(metric, math.nan)) for r in records]
        for name, metric in (
            ("entropy", "entropy"),
            ("kl", "kl"),
            ("w_max", "off_policy/weight_max"),
            ("grad_norm", "grad_norm"),
            ("update_norm", "collapse/update_norm"),
            ("adapter_norm", "collapse/adapter_norm"),
            ("adv_abs_max", "advantages/abs_max"),
            ("alarm", "collapse/alarm"),
            ("update_scale", "collapse/update_scale"),
            ("update_kl", "collapse/update_kl"),
            ("spike_clip", "collapse/spike_clip"),
        )
    }
    return {
        "settings": settings,
        "reward": rewards,
        "curves": curves,
        "wall_s": time.monotonic() - t0,
    }


def figures(row: dict[str, Any]) -> dict[str, Any]:
    r, c = row["reward"], row["curves"]
    at = reached(r, KEEP)
    half = len(r) // 2
    return {
        "step": reached(r, 0.5),
        "step90": at,
        "kept": kept(r),
        "last": statistics.fmean(r[-5:]),
        "entropy_max": max(c["entropy"][half:]),
        "update_max": max(c["update_norm"][at:]) if at else math.nan,
    }


def report(rows: list[dict[str, Any]], recipes: list[str]) -> None:
    print(
        "\n| recipe | staleness | seed | step>=0.5 | step>=0.9 | kept | last-5 | entropy max "
        "| update max |\n|---|---|---|---|---|---|---|---|---|"
    )
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in sorted(rows, key=lambda r: (recipes.index(r["recipe"]), r["staleness"], r["seed"])):
        f = figures(row)
        groups.setdefault((row["recipe"], row["staleness"]), []).append(f)
        kept_ = "-" if f["kept"] is None else f"{f['kept']:.3f}"
        print(
            f"| {row['recipe']} | {row['staleness']} | {row['seed']} | {f['step'] or 'never'} | "
            f"{f['step90'] or 'never'} | {kept_} | {f['last']:.3f} | {f['entropy_max']:.2f} | "
            f"{f['update_max']:.3f} |"
        )
    print(
        "\n| recipe | staleness | seeds | reached 0.9 | kept >= 0.8 | lowest kept | "
        "median step>=0.5 | last-5 median | last-5 min |\n|---|---|---|---|---|---|---|---|---|"
    )
    for (recipe, k), fs in groups.items():
        ks = [f["kept"] for f in fs if f["kept"] is not None]
        last = [f["last"] for f in fs]
        print(
            f"| {recipe} | {k} | {len(fs)} | {len(ks)} | {sum(x >= KEPT_BAR for x in ks)} | "
            f"{min(ks, default=math.nan):.3f} | "
            f"{statistics.median(f['step'] or math.inf for f in fs):g} | "
            f"{statistics.median(last):.3f} | {min(last):.3f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda v: [int(x) for x in v.split(",")]  # noqa: E731
    p.add_argument(
        "--recipe",
        type=parse_recipe,
        action="append",
        dest="recipes",
        help="'demo' (examples/tiny_cpu.yaml's settings) or NAME:FIELD=VALUE,... "
        "(TrainerConfig fields on top of the demo's); repeat to compare",
    )
    p.add_argument("--staleness", type=ints, default=[4], help="versions behind, per sample")
    p.add_argument("--seeds", type=ints, default=list(range(8)))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs in parallel (processes of one thread each: the results do not depend on it)",
    )
    p.add_argument("--report", action="store_true", help="only print the tables")
    args = p.parse_args()
    recipes = dict(args.recipes or [("demo", {})])
    import torch

    torch.set_num_threads(1)  # one thread: the same floating-point sums on every machine
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            done[row["key"]] = row
    if not args.report:
        from asyncgrpo.testing import make_tiny_model

        model = args.out / "model"
        if not (model / "config.json").exists():
            make_tiny_model(model, seed=0)  # the tests' tiny_model
        todo = [
            (f"{name}-k{k}-s{seed}-n{args.steps}", name, k, seed)
            for name in recipes
            for k in args.staleness
            for seed in args.seeds
        ]
        todo = [t for t in todo if t[0] not in done]
        with ProcessPoolExecutor(args.jobs) as pool:  # each run on one thread: jobs = cores
            futures = {
                pool.submit(run_one, model, recipes[name], k, args.steps, seed): key
                for key, name, k, seed in todo
            }
            for future in as_completed(futures):
                key = futures[future]
                _, name, k, seed = next(t for t in todo if t[0] == key)
                row = future.result()
                row.update(key=key, recipe=name, staleness=k, seed=seed, steps=args.steps)
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                done[key] = row
                fg = figures(row)
                print(
                    f"{key}: step>=0.5 {fg['step']} kept {fg['kept']} "
                    f"last-5 {fg['last']:.3f} ({row['wall_s']:.0f} s)",
                    flush=True,
                )
    wanted = [
        r
        for r in done.values()
        if r["recipe"] in recipes
        and r["steps"] == args.steps
        and r["staleness"] in args.staleness
        and r["seed"] in args.seeds
    ]
    report(wanted, list(recipes))


if __name__ == "__main__":
    main()

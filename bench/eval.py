"""What evaluating during training costs the trainer: the demo recipe with and without
``eval.every``, side by side in one invocation, on one fleet.

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

Run: ``python bench/eval.py [--every 5] [--seeds 0] [--steps 40]``.
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


def figures(run_dir: Path, wall: float) -> dict[str, Any]:
    from asyncgrpo.evaluation.records import read_evals
    from asyncgrpo.run.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    rewards = [float(r["reward"]) for r in records]
    step_s = [float(r["perf/step_s"]) for r in records]
    at = reached(rewards)
    evals = read_evals(run_dir)
    return {
        "s_step": statistics.median(step_s),
        "steps_per_s": len(step_s) / sum(step_s),
        "step": at,
        "secs": sum(step_s[:at]) if at else None,
        "evals": len(evals) - 2,
        "held": (evals[0]["eval/reward"], evals[-1]["eval/reward"]),
        "wall": wall,
    }


async def measure(args: argparse.Namespace) -> list[tuple[str, int, dict[str, Any]]]:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.training import run_training
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model

    out: Path = args.out
    model = make_tiny_model(out / "model", seed=0)
    base = TrainingConfig.from_yaml(EXAMPLE, [f"model={model}", f"eval.every={args.every}"])
    fleet = dataclasses.replace(base.serve, log_dir=str(out / "fleet-logs"),
                                transports=(str(out),),
                                adapter_cache_dir=str(out / "fleet-adapters"))  # fmt: skip
    print(f"starting {fleet.replicas} vLLM replicas (--max-loras {fleet.lora_slots})", flush=True)
    rows = []
    async with launch_replicas(fleet) as replicas:
        urls = ",".join(r.url for r in replicas)
        for i, seed in enumerate(args.seeds):
            order = [("off", 0), ("on", args.every)]
            for label, every in order if i % 2 == 0 else order[::-1]:
                name = f"{label}-s{seed}"
                shutil.rmtree(out / "runs" / name, ignore_errors=True)
                cfg = TrainingConfig.from_yaml(EXAMPLE, [
                    f"model={model}", f"output_dir={out / 'runs'}", f"run_name={name}",
                    f"seed={seed}", f"eval.every={every}", "serve.replicas=0",
                    f"proxy.upstreams=[{urls}]", f"trainer.max_steps={args.steps}",
                ])  # fmt: skip
                t0 = time.monotonic()
                result = await run_training(cfg)
                row = figures(result.run_dir, time.monotonic() - t0)
                rows.append((label, seed, row))
                print(f"{name}: {describe(row)}", flush=True)
    return rows


def describe(row: dict[str, Any]) -> str:
    secs = f"{row['secs']:.0f}" if row["secs"] is not None else "-"
    return (f"| {row['s_step']:.2f} | {row['steps_per_s']:.3f} | {row['step'] or '-'} | {secs} "
            f"| {row['evals']} | {row['held'][0]:.3f} -> {row['held'][1]:.3f} "
            f"| {row['wall']:.0f} |")  # fmt: skip


def report(rows: list[tuple[str, int, dict[str, Any]]], every: int) -> None:
    print("\n| eval.every | seed | s/step | steps/s | step>=0.5 | s to 0.5 | evals | held-out "
          "| wall s |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for label, seed, row in rows:
        print(f"| {every if label == 'on' else 0} | {seed} {describe(row)}")
    by = {label: [r for lab, _, r in rows if lab == label] for label in ("off", "on")}
    speed = [statistics.fmean(r["steps_per_s"] for r in by[k]) for k in ("off", "on")]
    print(f"\nsteps/s on / off: {speed[1] / speed[0]:.3f}")
    secs = [[r["secs"] for r in by[k] if r["secs"] is not None] for k in ("off", "on")]
    if all(secs):
        mean = [statistics.fmean(s) for s in secs]
        print(f"time to reward {THRESHOLD} on / off: {mean[1] / mean[0]:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=5, help="eval.every of the 'on' runs")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=40, help="trainer.max_steps")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    report(anyio.run(measure, args), args.every)


if __name__ == "__main__":
    main()

"""``asyncgrpo launch CONFIG --backend hf-jobs|ray|skypilot|local [--dry-run] [flags] [overrides...]``.

Starts the run's vLLM replicas and its trainer as jobs on Hugging Face Jobs (``hf-jobs``), as
actors on a Ray cluster (``ray``), as SkyPilot managed jobs on any cloud, Kubernetes or Slurm
(``skypilot``), or as separate process groups on this host (``local``), waits for each, and
follows them to the end. Every field of the ``launch`` section is also a flag (``--replicas 3``
is ``launch.replicas=3``; flags win over overrides); progress lines and failures go to the
terminal, each job's log to the launch's own directory ``<output_dir>/<run_name>-launch/``. It
ends with the same summary as ``asyncgrpo train`` (reward, held-out result, adapter version,
PEFT directory, metrics). Ctrl-C or SIGTERM cancels every job started.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config.flags import add_fields
from asyncgrpo.config.launch import LAUNCH_BACKENDS, LaunchConfig
from asyncgrpo.config.training import ENV_PREFIX


def add_parser(sub: Any) -> None:
    """The ``launch`` subcommand, on ``sub`` (the ``asyncgrpo`` command's subparsers)."""
    from asyncgrpo.cli.help import add_command

    p = add_command(
        sub,
        "launch",
        help="start a run across machines (Hugging Face Jobs, Ray, SkyPilot) or local processes",
        description=__doc__ or "",
        examples=[
            (
                "asyncgrpo launch examples/tiny_cpu.yaml --backend local --dry-run",
                "every job's command, and every check the launch makes first; start nothing",
            ),
            (
                "asyncgrpo launch examples/tiny_cpu.yaml --backend local",
                "replicas and trainer as separate local processes, in runs/tiny-cpu-launch",
            ),
        ],
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[], help="section.field=value overrides")
    p.add_argument(
        "--backend",
        choices=tuple(LAUNCH_BACKENDS),
        required=True,
        help="hf-jobs: Hugging Face Jobs; ray: Ray actors on a Ray cluster; skypilot: SkyPilot managed jobs (any "
        "cloud, Kubernetes, Slurm); local: separate process groups here",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print every job spec (secret names only; skypilot: each task's YAML, "
        "also written under <output_dir>/<run_name>-launch/skypilot/), make "
        "every check the launch makes before its first job (recipe, "
        "transport_url, local paths remote jobs cannot read, secrets), and start "
        "nothing",
    )
    add_fields(p.add_argument_group("the launch section"), LaunchConfig, env_prefix=ENV_PREFIX)
    p.set_defaults(func=run)


def overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of the command line, the ``launch`` flags' last (they win)."""
    out = list(args.overrides)
    for f in dataclasses.fields(LaunchConfig):
        value = getattr(args, f.name, None)
        if isinstance(value, list):  # --sweep, repeated: a YAML list keeps each entry whole
            value = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
        if value is not None:
            out.append(f"launch.{f.name}={value}")
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (what a user types)."""
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def metrics_lines(metrics: dict[str, Path | None], launch_dir: Path) -> list[str]:
    """Where each run's ``metrics.jsonl`` is (run name -> path; None: on the trainer job's
    machine), and the command that plots them."""
    here = {run: path for run, path in metrics.items() if path is not None}
    lines = [
        f"metrics of {run}: on its trainer job's machine, not on this host"
        for run, path in metrics.items()
        if path is None
    ]
    if len(metrics) == 1 and here:
        (path,) = here.values()
        return [f"metrics: {_shown(path)} (plot: asyncgrpo plot {_shown(launch_dir)})"]
    lines += [f"metrics of {run}: {_shown(path)}" for run, path in here.items()]
    if here:
        lines.append(f"plot every run: asyncgrpo plot {_shown(launch_dir)}")
    return lines


def launch_summary(handle: Any, records: list[dict[str, Any]], wall_s: float) -> list[str]:
    """What ``asyncgrpo train`` says at its end, for each run of the launch (from its trainer
    job's result line and progress lines), then where the metrics are and how to plot them."""
    from asyncgrpo.run.progress import summary_lines

    lines: list[str] = []
    many = len(handle.points) > 1
    missing = False
    for point, job in zip(handle.points, handle.trainers, strict=False):
        run = point.cfg.run_name
        found = handle.results.get(run)
        if found is None:  # an asyncgrpo on the job's machine older than this launcher
            lines.append(f"{run}: no summary (its trainer job printed no asyncgrpo-result line)")
            missing = True
            continue
        result, evals = found
        here = handle.backend.metrics_path(job) is not None
        if here:  # paths as a user types them
            result = dataclasses.replace(
                result,
                run_dir=Path(_shown(result.run_dir)),
                adapter_dir=Path(_shown(result.adapter_dir)) if result.adapter_dir else None,
            )
        ran = [r for r in records if r.get("run") == (run if many else None)]
        summary = summary_lines(
            result,
            ran,
            wall_s,
            evals=evals,
            where="" if here else " (on the trainer job's machine)",
            max_steps=point.cfg.trainer.max_steps,
        )
        lines += [f"{run}: {line}" for line in summary] if many else summary
    if missing or len(handle.points) > 1:
        lines += metrics_lines(handle.metrics, handle.launch_dir)
    elif any(handle.metrics.values()):  # the one run's metrics are here
        lines.append(f"plot: asyncgrpo plot {_shown(handle.launch_dir)}")
    return lines


def run(args: argparse.Namespace) -> None:
    import logging

    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.console import run_async
    from asyncgrpo.errors import LaunchError
    from asyncgrpo.launch.launcher import check_offline, dry_run, launch
    from asyncgrpo.run.progress import describe_progress

    cfg = TrainingConfig.from_yaml(args.config, overrides=overrides(args))
    if args.dry_run:
        print(dry_run(cfg, args.backend), flush=True)
        print("\n".join(check_offline(cfg, args.backend)))  # the real launch's refusals
        print("launch OK (dry run: nothing started)")
        return
    logging.getLogger("asyncgrpo.launch").setLevel(logging.INFO)

    def progress(record: dict[str, Any]) -> None:
        print(describe_progress(record), flush=True)

    async def main() -> None:
        handle = await launch(cfg, args.backend, on_progress=progress)
        async with handle:
            trainers = (
                "trainer started"
                if len(handle.trainers) == 1
                else (
                    f"{len(handle.trainers)} trainers started, one per point: "
                    + "; ".join(f"{p.cfg.run_name} {p.label}" for p in handle.points)
                )
            )
            print(
                f"replicas healthy at {', '.join(handle.urls)}; {trainers}; logs in "
                f"{handle.launch_dir}",
                flush=True,
            )
            try:
                records = await handle.wait()
            except LaunchError:  # what the failed runs wrote is still worth a look
                print("\n".join(metrics_lines(handle.metrics, handle.launch_dir)), flush=True)
                raise
        last = {r.get("run"): describe_progress(r) for r in records}  # each run's last line
        done = "; ".join(last.values()) or "no progress lines"
        what = "trainer" if len(handle.trainers) == 1 else "every trainer"
        print(f"{what} completed ({done}); every job stopped", flush=True)
        print("\n".join(launch_summary(handle, records, time.monotonic() - began)), flush=True)

    began = time.monotonic()
    try:
        run_async(main, stopping="cancelling every job of the launch (a few seconds)")
    except KeyboardInterrupt:
        print("interrupted: every job of the launch was cancelled", file=sys.stderr)
        raise

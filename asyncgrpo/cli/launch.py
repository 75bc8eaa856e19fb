"""``asyncgrpo launch CONFIG --backend hf-jobs|ray|skypilot|local [--dry-run] [flags] [overrides...]``.

Every field of the ``launch`` section is also a flag (``--replicas 3`` is ``launch.replicas=3``;
flags win over overrides); progress lines and failures go to the terminal, each job's log to
``<run_dir>/launch/``. The last lines say where each run's metrics are (``asyncgrpo plot
<run_dir>/launch`` draws them). Ctrl-C or SIGTERM cancels every job started.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config.flags import add_fields
from asyncgrpo.config.training import ENV_PREFIX
from asyncgrpo.console import plain_help
from asyncgrpo.launch.config import LaunchConfig


def add_parser(sub: Any) -> None:
    """The ``launch`` subcommand, on ``sub`` (the ``asyncgrpo`` command's subparsers)."""
    p = sub.add_parser(
        "launch",
        help="start a run across machines (Hugging Face Jobs, Ray, SkyPilot) or local processes",
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[], help="section.field=value overrides")
    p.add_argument("--backend", choices=("hf-jobs", "ray", "skypilot", "local"), required=True,
                   help="hf-jobs: Hugging Face Jobs; ray: Ray actors on a Ray cluster; skypilot: SkyPilot managed jobs (any "
                        "cloud, Kubernetes, Slurm); local: separate process groups here")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print every job spec (secret names only; skypilot: each task's YAML, "
                        "also written under <run_dir>/launch/skypilot/) and start nothing")  # fmt: skip
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
    lines = [f"metrics of {run}: on its trainer job's machine, not on this host"
             for run, path in metrics.items() if path is None]  # fmt: skip
    if len(metrics) == 1 and here:
        (path,) = here.values()
        return [f"metrics: {_shown(path)} (plot: asyncgrpo plot {_shown(launch_dir)})"]
    lines += [f"metrics of {run}: {_shown(path)}" for run, path in here.items()]
    if here:
        lines.append(f"plot every run: asyncgrpo plot {_shown(launch_dir)}")
    return lines


def run(args: argparse.Namespace) -> None:
    import logging

    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.console import run_async
    from asyncgrpo.errors import LaunchError
    from asyncgrpo.launch.launcher import dry_run, launch
    from asyncgrpo.run.progress import describe_progress

    cfg = TrainingConfig.from_yaml(args.config, overrides=overrides(args))
    if args.dry_run:
        print(dry_run(cfg, args.backend))
        return
    logging.getLogger("asyncgrpo.launch").setLevel(logging.INFO)

    def progress(record: dict[str, Any]) -> None:
        print(describe_progress(record), flush=True)

    async def main() -> None:
        handle = await launch(cfg, args.backend, on_progress=progress)
        async with handle:
            started = "trainer started" if len(handle.trainers) == 1 else (
                f"{len(handle.trainers)} trainers started, one per point: "
                + "; ".join(f"{p.cfg.run_name} {p.label}" for p in handle.points)
            )  # fmt: skip
            print(f"replicas healthy at {', '.join(handle.urls)}; {started}; logs in "
                  f"{handle.launch_dir}", flush=True)  # fmt: skip
            try:
                records = await handle.wait()
            except LaunchError:  # what the failed runs wrote is still worth a look
                print("\n".join(metrics_lines(handle.metrics, handle.launch_dir)), flush=True)
                raise
        last = {r.get("run"): describe_progress(r) for r in records}  # each run's last line
        done = "; ".join(last.values()) or "no progress lines"
        what = "trainer" if len(handle.trainers) == 1 else "every trainer"
        print(f"{what} completed ({done}); every job stopped", flush=True)
        print("\n".join(metrics_lines(handle.metrics, handle.launch_dir)), flush=True)

    try:
        run_async(main)
    except KeyboardInterrupt:
        print("interrupted: every job of the launch was cancelled", file=sys.stderr)
        raise

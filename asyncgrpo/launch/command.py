"""``asyncgrpo launch CONFIG --backend hf-jobs|local [--dry-run] [flags] [overrides...]``.

The flags are shorthands for ``launch.*`` overrides; progress lines and failures go to the
terminal, each job's log to ``<run_dir>/launch/``. Ctrl-C or SIGTERM cancels every job started.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: flag -> launch config field
FLAGS = {
    "--replicas": ("replicas", int, "inference jobs (launch.replicas)"),
    "--replica-flavor": ("replica_flavor", str, "hardware of each inference job"),
    "--trainer-flavor": ("trainer_flavor", str, "hardware of the trainer job"),
    "--image": ("image", str, "Docker image of the jobs (launch.image)"),
    "--namespace": ("namespace", str, "user or organisation the jobs run under"),
}


class _IntermixedParser(argparse.ArgumentParser):
    """Lets overrides follow the flags (``launch CONFIG --backend local --replicas 3 x=1``):
    plain argparse stops taking positionals once an option came after them."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._inner:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch",
        help="start a run across machines (Hugging Face Jobs) or local processes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    p.add_argument("--backend", choices=("hf-jobs", "local"), required=True,
                   help="hf-jobs: Hugging Face Jobs; local: separate process groups here")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print every job spec (secret names only) and start nothing")  # fmt: skip
    for flag, (_, kind, text) in FLAGS.items():
        p.add_argument(flag, type=kind, default=None, help=text)
    p.set_defaults(func=run)
    # The subcommand's parser is built by the top-level parser's class; give it intermixing.
    p.__class__ = _IntermixedParser


def overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides of the command line, the flags' last (they win)."""
    out = list(args.overrides)
    for flag, (name, _, _) in FLAGS.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            out.append(f"launch.{name}={value}")
    return out


def run(args: argparse.Namespace) -> None:
    import logging

    from asyncgrpo.cli import _run
    from asyncgrpo.config import TrainingConfig
    from asyncgrpo.launch.launcher import dry_run, launch
    from asyncgrpo.launch.progress import describe_progress

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
            print(f"replicas healthy at {', '.join(handle.urls)}; trainer started; logs in "
                  f"{handle.launch_dir}", flush=True)  # fmt: skip
            records = await handle.wait()
        last = describe_progress(records[-1]) if records else "no progress lines"
        print(f"trainer completed ({last}); every job stopped", flush=True)

    try:
        _run(main)
    except BaseExceptionGroup as group:  # the CLI's task group wraps what the launch raised
        raise _single(group) from None
    except KeyboardInterrupt:
        print("interrupted: every job of the launch was cancelled", file=sys.stderr)
        raise


def _single(group: BaseExceptionGroup) -> BaseException:
    """The one error inside (nested) groups of one, so the CLI reports it plainly."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error

"""The ``asyncgrpo`` command.

- ``asyncgrpo demo [--output-dir DIR]``: the tiny CPU example end to end (the README's main job)
- ``asyncgrpo train CONFIG [key=value ...] [--remote-rollouts] [--dry-run]``: train (in one
  process, or fed by rollout processes through the transport); ``--dry-run`` checks the recipe;
  ``torchrun --nproc-per-node N -m asyncgrpo train CONFIG`` trains data-parallel over N ranks
- ``asyncgrpo rollout CONFIG [key=value ...]``: a rollout process for a split run
- ``asyncgrpo launch CONFIG --backend hf-jobs|local [--dry-run]``: the run across machines
  (Hugging Face Jobs) or as separate local processes; Ctrl-C cancels every job
- ``asyncgrpo plot RUN_DIR``: reward, ratio, step time and staleness to ``RUN_DIR/plot.png``
- ``asyncgrpo check-serving [--output-dir DIR]``: served logprobs equal transformers + peft's
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.settings import ConfigParser, exit_on_config_error

T = TypeVar("T")


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn`` under anyio with SIGINT and SIGTERM turned into cancellation, so replicas,
    the proxy and the rollout client shut down cleanly (no orphan vLLM processes)."""
    import anyio

    interrupted = False

    async def main() -> T | None:
        nonlocal interrupted
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            result = await fn(*args)
            tg.cancel_scope.cancel()
            return result

    result = anyio.run(main)
    if interrupted:
        raise KeyboardInterrupt
    return result  # type: ignore[return-value]


def _load(args: argparse.Namespace):
    from asyncgrpo.config import TrainingConfig

    return TrainingConfig.from_yaml(args.config, overrides=args.overrides)


def _train(args: argparse.Namespace) -> None:
    cfg = _load(args)  # first: a bad setting fails before the heavy imports
    from asyncgrpo.run import run_training

    if args.dry_run:
        from asyncgrpo.preflight import dry_run

        print("\n".join(dry_run(cfg)))
        print("recipe OK (dry run: nothing started or downloaded)")
        return
    source = "channel" if args.remote_rollouts else "local"
    result = _run(lambda: run_training(cfg, rollout_source=source))
    if result.rank == 0:  # under torchrun, rank 0 speaks for the job
        print(f"trained {result.steps} steps; final adapter {result.adapter_prefix}-v"
              f"{result.final_version} in {result.transport_url}; metrics in {result.run_dir}")  # fmt: skip


def _rollout(args: argparse.Namespace) -> None:
    cfg = _load(args)
    from asyncgrpo.run import run_rollouts

    shipped = _run(run_rollouts, cfg)
    print(f"shipped {shipped} samples")


def _plot(args: argparse.Namespace) -> None:
    from asyncgrpo.plot import plot_run

    print(plot_run(args.run_dir))


def _demo(args: argparse.Namespace) -> None:
    from asyncgrpo.demo import run_demo

    _run(run_demo, Path(args.output_dir), args.max_steps)


def _check_serving(args: argparse.Namespace) -> None:
    from asyncgrpo.demo import run_serving_check

    _run(run_serving_check, Path(args.output_dir), args.replicas)


def main(argv: Sequence[str] | None = None) -> None:
    parser = ConfigParser(
        prog="asyncgrpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the tiny CPU demo end to end")
    demo.add_argument("--output-dir", default="runs/demo", help="model, run directory, plot")
    demo.add_argument("--max-steps", type=int, default=None, help="override the demo's steps")
    demo.set_defaults(func=_demo)

    for name, func, text in (
        ("train", _train, "train from a YAML config"),
        ("rollout", _rollout, "run a rollout process for a split run"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="YAML config file")
        p.add_argument(
            "overrides",
            nargs="*",
            help="section.field=value overrides; ASYNCGRPO_SECTION__FIELD variables also override",
        )
        p.set_defaults(func=func)
        if name == "train":
            p.add_argument("--remote-rollouts", action="store_true",
                           help="take samples from `asyncgrpo rollout` processes via the transport")  # fmt: skip
            p.add_argument("--dry-run", action="store_true",
                           help="check the recipe (rewards import, replica flags, context) and exit")  # fmt: skip

    from asyncgrpo.launch.command import add_parser as add_launch_parser

    add_launch_parser(sub)

    plot = sub.add_parser("plot", help="plot a run's metrics.jsonl to plot.png")
    plot.add_argument("run_dir")
    plot.set_defaults(func=_plot)

    check = sub.add_parser("check-serving", help="served logprobs vs transformers + peft")
    check.add_argument("--output-dir", default="runs/check-serving")
    check.add_argument("--replicas", type=int, default=2)
    check.set_defaults(func=_check_serving)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_and_exit(lambda: args.func(args), parser.prog)


def run_and_exit(body: Callable[[], object], prog: str) -> NoReturn:
    """Run a command's body and exit with its status: 0; 2 and one line for a setting the user
    can fix (like argparse's own errors); 1 and the message for any other asyncgrpo error;
    130 on Ctrl-C or SIGTERM. Never a traceback for a user mistake."""
    try:
        body()
    except ConfigError as exc:
        exit_on_config_error(prog, exc)
    except AsyncGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        exit_process(1)
    except KeyboardInterrupt:
        exit_process(130)
    exit_process(0)


def exit_process(code: int) -> NoReturn:
    """Exit with ``code`` without interpreter teardown, once output and logs are flushed.

    obstore's background runtime (the S3, GCS, Azure and HF-bucket transports) can abort the
    process (SIGABRT) while Python finalizes, after all work is done: 5 of 20 runs of a plain
    put/get script against a loopback S3 server here, 2 of 20 with obstore alone. A finished
    run must not report a crash to whoever reads its exit status (a launcher, torchrun, CI).
    Everything that must outlive the process is closed before this point (the run's exit
    stack closes the metrics writer and the transport).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

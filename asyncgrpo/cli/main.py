"""The ``asyncgrpo`` command.

- ``asyncgrpo demo [--output-dir DIR]``: the tiny CPU example end to end (the README's main job)
- ``asyncgrpo train CONFIG [key=value ...] [--remote-rollouts] [--dry-run] [--quiet]``: train (in
  one process, or fed by rollout processes through the transport), showing its phases, a line
  or a progress bar per step and a summary (``--quiet``: one line); ``--dry-run`` checks the recipe;
  ``torchrun --nproc-per-node N -m asyncgrpo train CONFIG`` trains data-parallel over N ranks
- ``asyncgrpo rollout CONFIG [key=value ...]``: a rollout process for a split run
- ``asyncgrpo launch CONFIG --backend hf-jobs|ray|skypilot|local [--dry-run]``: the run across machines
  (Hugging Face Jobs) or as separate local processes; Ctrl-C cancels every job
- ``asyncgrpo eval CONFIG [--version N | --base | --all]``: held-out evaluation of published
  versions of a run (its ``eval`` section), on its fleet or on replicas it starts
- ``asyncgrpo export RUN_DIR DIR [--version N]``: a published adapter version as a plain PEFT
  directory
- ``asyncgrpo plot RUN_DIR``: reward, ratio, step time and staleness to ``RUN_DIR/plot.png``
- ``asyncgrpo check-serving [--output-dir DIR]``: served logprobs equal transformers + peft's
- ``asyncgrpo tinker --model DIR [--port P]``: the Tinker-compatible service (the ``tinker``
  SDK's REST API over this trainer); its flags are ``python -m asyncgrpo.tinker``'s
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from asyncgrpo.config.flags import ConfigParser, int_in
from asyncgrpo.console import parse_command_line, plain_help, run_async, run_command
from asyncgrpo.errors import DEBUG_HELP, ConfigError
from asyncgrpo.vllm.api import MAX_VERSION, served_name


class CommandParser(ConfigParser):
    """A subcommand's parser: overrides may follow its flags (``launch CONFIG --backend local
    --replicas 3 x=1``), which plain argparse refuses once an option came after a positional."""

    _intermixing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # also after the subcommand (`asyncgrpo train CONFIG --debug`); unset here leaves the
        # top-level parser's value
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help=DEBUG_HELP)  # fmt: skip

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        if self._intermixing:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _load(args: argparse.Namespace):
    from asyncgrpo.config.training import TrainingConfig

    return TrainingConfig.from_yaml(args.config, overrides=args.overrides)


def _train(args: argparse.Namespace) -> None:
    cfg = _load(args)  # first: a bad setting fails before the heavy imports
    from asyncgrpo.run.training import run_training

    if args.dry_run:
        from asyncgrpo.run.preflight import dry_run

        print("\n".join(dry_run(cfg)))
        print("recipe OK (dry run: nothing started or downloaded)")
        return
    from asyncgrpo.run.metrics import METRICS_FILE, read_metrics
    from asyncgrpo.run.progress import ConsoleProgress, Silent, summary_lines

    source = "channel" if args.remote_rollouts else "local"
    # under torchrun, rank 0 speaks for the job
    speaks = not args.quiet and os.environ.get("RANK", "0") == "0"
    started = time.monotonic()
    with ConsoleProgress(cfg.trainer.max_steps) if speaks else nullcontext(Silent()) as progress:
        result = run_async(lambda: run_training(cfg, rollout_source=source, progress=progress))
    if result.rank != 0:
        return
    if args.quiet:
        final = served_name(result.adapter_prefix, result.final_version)
        print(f"trained {result.steps} steps; final adapter {final} in {result.transport_url} "
              f"and, as a PEFT directory, in {result.adapter_dir}; metrics in {result.run_dir}")  # fmt: skip
        return
    metrics = result.run_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.is_file() else []
    print("\n".join(summary_lines(result, records, time.monotonic() - started)))
    print(f"final adapter as a PEFT directory: {result.adapter_dir}")


def _rollout(args: argparse.Namespace) -> None:
    cfg = _load(args)
    from asyncgrpo.run.progress import ConsoleProgress
    from asyncgrpo.run.rollouts import run_rollouts

    with ConsoleProgress(cfg.trainer.max_steps) as progress:  # phases only: it takes no step
        shipped = run_async(lambda: run_rollouts(cfg, progress=progress))
    print(f"shipped {shipped} samples")


def _eval(args: argparse.Namespace) -> None:
    cfg = _load(args)
    if cfg.eval is None:
        raise ConfigError(f"{args.config} has no eval section: add one (docs/eval.md)")
    from asyncgrpo.evaluation.records import EVAL_METRICS_FILE
    from asyncgrpo.run.evaluation import evaluate_published

    results = run_async(
        lambda: evaluate_published(cfg, version=args.version, base=args.base, every=args.all)
    )
    k = cfg.eval.num_generations
    for m in results:
        print(f"version {int(m['eval/version'])}: reward {m['eval/reward']:.3f}, pass@1 "
              f"{m.get('eval/pass@1', float('nan')):.3f}, pass@{k} "
              f"{m.get(f'eval/pass@{k}', float('nan')):.3f} over {int(m['eval/prompts'])} "
              "prompts")  # fmt: skip
    print(f"in {cfg.run_dir / EVAL_METRICS_FILE} (completions in {cfg.run_dir / 'eval.jsonl'})")


def _plot(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.plot import plot_runs

    plots = plot_runs(args.run_dir)
    for run, png in plots.items():
        print(png if len(plots) == 1 else f"{run}: {png}")


def _demo(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.demo import run_demo

    run_async(run_demo, Path(args.output_dir), args.max_steps)


def _check_serving(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.demo import run_serving_check

    run_async(run_serving_check, Path(args.output_dir), args.replicas)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tinker"]:  # its own parser: every TinkerConfig field is a flag
        from asyncgrpo.tinker.__main__ import main as tinker_main

        tinker_main(argv[1:], prog="asyncgrpo tinker")
    parser = ConfigParser(
        prog="asyncgrpo",
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    demo = sub.add_parser("demo", help="run the tiny CPU demo end to end")
    demo.add_argument("--output-dir", default="runs/demo", help="model, run directory, plot")
    demo.add_argument("--max-steps", type=int_in(1, 100_000), default=None,
                      help="override the demo's steps")  # fmt: skip
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
            default=[],  # optional: without a default argparse calls it required
            help="section.field=value overrides; ASYNCGRPO_SECTION__FIELD variables also override",
        )
        p.set_defaults(func=func)
        if name == "train":
            p.add_argument("--remote-rollouts", action="store_true",
                           help="take samples from `asyncgrpo rollout` processes via the transport")  # fmt: skip
            p.add_argument("--dry-run", action="store_true",
                           help="check the recipe (rewards import, replica flags, context) and exit")  # fmt: skip
            p.add_argument("--quiet", action="store_true",
                           help="no phases, no progress: one line at the end (for scripts)")  # fmt: skip

    from asyncgrpo.cli.launch import add_parser as add_launch_parser

    add_launch_parser(sub)

    ev = sub.add_parser("eval", help="evaluate published versions of a run on held-out prompts")
    ev.add_argument("config", help="the run's YAML config (with an eval section)")
    ev.add_argument("overrides", nargs="*", help="section.field=value overrides")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--version", type=int_in(0, MAX_VERSION), default=None,
                       help="this version (default: newest)")  # fmt: skip
    which.add_argument("--base", action="store_true", help="version 0: the base model")
    which.add_argument("--all", action="store_true", help="every published version")
    ev.set_defaults(func=_eval)

    from asyncgrpo.cli.export import add_parser as add_export_parser

    add_export_parser(sub)

    plot = sub.add_parser("plot", help="plot a run's metrics.jsonl to plot.png")
    plot.add_argument("run_dir", help="a run directory, or a launch's (a sweep: every point)")
    plot.set_defaults(func=_plot)

    check = sub.add_parser("check-serving", help="served logprobs vs transformers + peft")
    check.add_argument("--output-dir", default="runs/check-serving")
    check.add_argument("--replicas", type=int_in(1, 32), default=2,
                       help="vLLM replicas to check (1 to 32)")  # fmt: skip
    check.set_defaults(func=_check_serving)

    sub.add_parser("tinker", help="serve the tinker SDK's API (asyncgrpo tinker --help)")

    args = parse_command_line(lambda: parser.parse_args(argv), parser.prog)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_command(lambda: args.func(args), parser.prog, debug=args.debug)


if __name__ == "__main__":
    main()

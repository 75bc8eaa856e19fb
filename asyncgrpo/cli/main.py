"""The ``asyncgrpo`` command.

- ``asyncgrpo demo [--output-dir DIR]``: the tiny CPU example end to end (the README's main job)
- ``asyncgrpo train CONFIG [key=value ...] [--remote-rollouts] [--dry-run] [--quiet]``: train (in
  one process, or fed by rollout processes through the transport), showing its phases, a line
  or a progress bar per step and a summary (``--quiet``: one line); ``--dry-run`` checks the recipe;
  ``torchrun --nproc-per-node N -m asyncgrpo train CONFIG`` trains data-parallel over N ranks
- ``asyncgrpo rollout CONFIG [key=value ...] [--dry-run]``: a rollout process for a split run
- ``asyncgrpo launch CONFIG --backend hf-jobs|ray|skypilot|local [--dry-run]``: the run across
  machines (Hugging Face Jobs, a Ray cluster, SkyPilot on any cloud, Kubernetes or Slurm) or as
  separate local processes; Ctrl-C cancels every job
- ``asyncgrpo eval CONFIG [--version N | --base | --all] [--dry-run]``: held-out evaluation of published
  versions of a run (its ``eval`` section), on its fleet or on replicas it starts
- ``asyncgrpo export RUN_DIR DIR [--version N] [--base-model name|relative|...]``: a published
  adapter version as a plain PEFT directory
- ``asyncgrpo plot RUN_DIR``: reward, ratio, step time and staleness to ``RUN_DIR/plot.png``
- ``asyncgrpo check-serving [--output-dir DIR] [--dry-run]``: served logprobs equal
  transformers + peft's
- ``asyncgrpo tinker --model DIR [--port P]``: the Tinker-compatible service (the ``tinker``
  SDK's REST API over this trainer); its flags are ``python -m asyncgrpo.tinker``'s

Each command's --help says what it does and shows examples that run as typed from a checkout.
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

from asyncgrpo.cli.help import add_command
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
        self.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
        )

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
        _recipe_checked(cfg, "recipe")
        return
    from asyncgrpo.run.progress import ConsoleProgress, Silent, run_summary

    source = "channel" if args.remote_rollouts else "local"
    # under torchrun, rank 0 speaks for the job
    speaks = not args.quiet and os.environ.get("RANK", "0") == "0"
    started = time.monotonic()
    with ConsoleProgress(cfg.trainer.max_steps) if speaks else nullcontext(Silent()) as progress:
        result = run_async(
            lambda: run_training(cfg, rollout_source=source, progress=progress),
            stopping=TRAIN_STOPPING,
        )
    if result.rank != 0:
        return
    if args.quiet:
        final = served_name(result.adapter_prefix, result.final_version)
        did = (
            "nothing to train (already at trainer.max_steps)"
            if result.up_to_date
            else (f"trained {result.steps} steps")
        )
        peft = f" and, as a PEFT directory, in {result.adapter_dir}" if result.adapter_dir else ""
        print(
            f"{did}; final adapter {final} in {result.transport_url}{peft}; metrics in "
            f"{result.run_dir}"
        )
        return
    wall = time.monotonic() - started
    print("\n".join(run_summary(result, wall, max_steps=cfg.trainer.max_steps)))


#: What the first Ctrl-C of ``asyncgrpo train`` says it does.
TRAIN_STOPPING = (
    "stopping the run: rollouts end, adapters are unloaded, replicas and proxy stop (up to "
    "about 30 s); its last checkpoint is kept and the same command resumes from it"
)


def _recipe_checked(cfg: Any, what: str) -> None:
    """A command's ``--dry-run``: every check a start makes first, printed; nothing started."""
    from asyncgrpo.run.preflight import dry_run

    print("\n".join(dry_run(cfg)))
    print(f"{what} OK (dry run: nothing started or downloaded)")


def _rollout(args: argparse.Namespace) -> None:
    cfg = _load(args)
    if args.dry_run:
        _recipe_checked(cfg, "rollout config")
        return
    from asyncgrpo.run.progress import ConsoleProgress
    from asyncgrpo.run.rollouts import run_rollouts

    with ConsoleProgress(cfg.trainer.max_steps) as progress:  # phases only: it takes no step
        shipped = run_async(lambda: run_rollouts(cfg, progress=progress))
    print(f"shipped {shipped} samples")


def _eval(args: argparse.Namespace) -> None:
    cfg = _load(args)
    if cfg.eval is None:
        raise ConfigError(f"{args.config} has no eval section: add one (docs/eval.md)")
    if args.dry_run:
        _recipe_checked(cfg, "eval config")
        return
    from asyncgrpo.evaluation.records import EVAL_FILE, EVAL_METRICS_FILE
    from asyncgrpo.run.evaluation import evaluate_published
    from asyncgrpo.run.progress import ConsoleProgress

    with ConsoleProgress(0) as progress:  # phases only: replicas, loads, prompts graded
        results = run_async(
            lambda: evaluate_published(
                cfg, version=args.version, base=args.base, every=args.all, progress=progress
            )
        )
    k = cfg.eval.num_generations
    for m in results:
        print(
            f"version {int(m['eval/version'])}: reward {m['eval/reward']:.3f}, pass@1 "
            f"{m.get('eval/pass@1', float('nan')):.3f}, pass@{k} "
            f"{m.get(f'eval/pass@{k}', float('nan')):.3f} over {int(m['eval/prompts'])} "
            "prompts"
        )
    print(f"in {cfg.run_dir / EVAL_METRICS_FILE} (completions in {cfg.run_dir / EVAL_FILE})")


def _plot(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.plot import plot_runs

    plots = plot_runs(args.run_dir)
    for run, png in plots.items():
        print(png if len(plots) == 1 else f"{run}: {png}")


def _demo(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.demo import demo_config, prepare_output_dir, run_demo

    if args.dry_run:
        prepare_output_dir(Path(args.output_dir), fresh=True, dry_run=True)
        _recipe_checked(demo_config(Path(args.output_dir), args.max_steps), "demo")
        return
    run_async(run_demo, Path(args.output_dir), args.max_steps)


def _check_serving(args: argparse.Namespace) -> None:
    from asyncgrpo.cli.demo import prepare_output_dir, run_serving_check

    if args.dry_run:
        out = prepare_output_dir(Path(args.output_dir), fresh=False, dry_run=True)
        print(f"output directory: {out} (usable)\ncheck-serving OK (dry run: nothing started)")
        return
    run_async(run_serving_check, Path(args.output_dir), args.replicas)


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument(
        "overrides",
        nargs="*",
        default=[],  # optional: without a default argparse calls it required
        help="section.field=value overrides; ASYNCGRPO_SECTION__FIELD variables also override",
    )


def _dry_run_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--dry-run", action="store_true", help=text)


def _add_demo(sub: Any) -> None:
    """``asyncgrpo demo``."""
    demo = add_command(
        sub,
        "demo",
        help="run the tiny CPU demo end to end",
        description="Build a tiny Qwen2 model here (no Hub access), start two vLLM replicas on "
        "CPU behind the proxy, train a LoRA adapter with async GRPO on a synthetic task, check "
        "that the logprobs vLLM served equal the trainer's, and leave metrics and a plot in "
        "--output-dir (about 3 minutes on 2 cores).",
        examples=[
            (
                "asyncgrpo demo --dry-run",
                "check the output directory and the demo's recipe, start nothing",
            ),
            ("asyncgrpo demo --max-steps 10", "a shorter demo, in runs/demo"),
        ],
    )
    demo.add_argument("--output-dir", default="runs/demo", help="model, run directory, plot")
    demo.add_argument(
        "--max-steps", type=int_in(1, 100_000), default=None, help="override the demo's steps"
    )
    _dry_run_flag(demo, "check the output directory and the demo's recipe, start nothing")
    demo.set_defaults(func=_demo)


def _add_train(sub: Any) -> None:
    """``asyncgrpo train``."""
    train = add_command(
        sub,
        "train",
        help="train from a YAML config",
        description="Train a LoRA adapter with async GRPO as one YAML config says: start the "
        "vLLM replicas it names (or use the ones in proxy.upstreams), publish a new adapter "
        "version every trainer.weight_sync_steps, checkpoint, and end with a summary (reward, "
        "held-out result, final adapter and its PEFT directory, metrics). It resumes from the "
        "run's last checkpoint; every check of --dry-run runs first, before anything starts. "
        "Under torchrun --nproc-per-node N -m asyncgrpo train CONFIG it trains over N ranks.",
        examples=[
            (
                "asyncgrpo train examples/tiny_cpu.yaml --dry-run",
                "check the recipe: rewards, dataset, paths, replica flags; start nothing",
            ),
            (
                "asyncgrpo train examples/tiny_cpu.yaml trainer.max_steps=100",
                "train (build the model first: python -m asyncgrpo.testing.tiny runs/tiny-model)",
            ),
        ],
    )
    _config_arguments(train)
    train.add_argument(
        "--remote-rollouts",
        action="store_true",
        help="take samples from `asyncgrpo rollout` processes via the transport",
    )
    _dry_run_flag(
        train,
        "check the recipe (rewards import, dataset parses, paths writable, "
        "replica flags, context, held-out rows) and exit",
    )
    train.add_argument(
        "--quiet",
        action="store_true",
        help="no phases, no progress: one line at the end (for scripts)",
    )
    train.set_defaults(func=_train)


def _add_rollout(sub: Any) -> None:
    """``asyncgrpo rollout``."""
    rollout = add_command(
        sub,
        "rollout",
        help="run a rollout process for a split run",
        description="Generate rollouts for a run whose trainer takes them through the "
        "transport (asyncgrpo train CONFIG --remote-rollouts, elsewhere): it follows the "
        "trainer's published versions and ships scored samples until the trainer finishes.",
        examples=[
            (
                "asyncgrpo rollout examples/tiny_cpu.yaml --dry-run",
                "check the config, start nothing",
            ),
            (
                "asyncgrpo rollout examples/tiny_cpu.yaml serve.replicas=0 "
                "'proxy.upstreams=[http://127.0.0.1:9000]'",
                "generate through the asyncgrpo proxy at that URL (python -m "
                "asyncgrpo.proxy), for a trainer started with --remote-rollouts and the same "
                "overrides",
            ),
        ],
    )
    _config_arguments(rollout)
    _dry_run_flag(rollout, "check the config (rewards import, dataset parses, paths) and exit")
    rollout.set_defaults(func=_rollout)


def _add_eval(sub: Any) -> None:
    """``asyncgrpo eval``."""
    ev = add_command(
        sub,
        "eval",
        help="evaluate published versions of a run on held-out prompts",
        description="Evaluate published adapter versions of a run (finished or running) on the "
        "held-out prompts of its config's eval section: k completions per prompt, reward, "
        "pass@1 and pass@k, written to the run directory beside its own evaluations. It uses "
        "the config's fleet (proxy.upstreams) or starts the replicas it names.",
        examples=[
            (
                "asyncgrpo eval examples/tiny_cpu.yaml --dry-run",
                "check the eval section and the held-out rows, start nothing",
            ),
            (
                "asyncgrpo eval examples/tiny_cpu.yaml --all",
                "every published version of the run in runs/tiny-cpu",
            ),
        ],
    )
    ev.add_argument("config", help="the run's YAML config (with an eval section)")
    ev.add_argument("overrides", nargs="*", help="section.field=value overrides")
    which = ev.add_mutually_exclusive_group()
    which.add_argument(
        "--version",
        type=int_in(0, MAX_VERSION),
        default=None,
        help="this version (default: newest)",
    )
    which.add_argument("--base", action="store_true", help="version 0: the base model")
    which.add_argument("--all", action="store_true", help="every published version")
    _dry_run_flag(ev, "check the config and the held-out rows and exit")
    ev.set_defaults(func=_eval)


def _add_plot(sub: Any) -> None:
    """``asyncgrpo plot``."""
    plot = add_command(
        sub,
        "plot",
        help="plot a run's metrics.jsonl to plot.png",
        description="Draw reward, ratio, step time, staleness and the held-out results of a "
        "run (or of every run of a launch, a sweep's points side by side) to plot.png in its "
        "directory.",
        examples=[("asyncgrpo plot runs/tiny-cpu", "runs/tiny-cpu/plot.png")],
    )
    plot.add_argument("run_dir", help="a run directory, or a launch's (a sweep: every point)")
    plot.set_defaults(func=_plot)


def _add_check(sub: Any) -> None:
    """``asyncgrpo check-serving``."""
    check = add_command(
        sub,
        "check-serving",
        help="served logprobs vs transformers + peft",
        description="Build a tiny model and a LoRA adapter, serve them on vLLM replicas, and "
        "compare every served token logprob with transformers + peft's (float32: equal within "
        "1e-4). What lets async GRPO trust the logprobs vLLM returns.",
        examples=[
            ("asyncgrpo check-serving --dry-run", "check the output directory"),
            ("asyncgrpo check-serving --replicas 1", "one replica, in runs/check-serving"),
        ],
    )
    check.add_argument(
        "--output-dir",
        default="runs/check-serving",
        help="where the model, the adapter, the replicas' logs and "
        "logprob_check.json go (made if missing; a demo's own or empty)",
    )
    check.add_argument(
        "--replicas", type=int_in(1, 32), default=2, help="vLLM replicas to check (1 to 32)"
    )
    _dry_run_flag(check, "check the output directory and exit")
    check.set_defaults(func=_check_serving)


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

    for add in (_add_demo, _add_train, _add_rollout):
        add(sub)
    from asyncgrpo.cli.export import add_parser as add_export_parser
    from asyncgrpo.cli.launch import add_parser as add_launch_parser

    add_launch_parser(sub)
    _add_eval(sub)
    add_export_parser(sub)
    _add_plot(sub)
    _add_check(sub)
    sub.add_parser("tinker", help="serve the tinker SDK's API (asyncgrpo tinker --help)")

    args = parse_command_line(lambda: parser.parse_args(argv), parser.prog)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_command(lambda: args.func(args), parser.prog, debug=args.debug)


if __name__ == "__main__":
    main()

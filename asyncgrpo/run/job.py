"""``python -m asyncgrpo.run.job [section.field=value ...]``: the trainer job of a launch.

``asyncgrpo train`` for a machine that has no copy of the config file: the config arrives as
YAML in ``$ASYNCGRPO_CONFIG`` (secrets emptied), the replicas' URLs as overrides on the command
line, and secrets as the job's secret environment variables (``ASYNCGRPO_PROXY__UPSTREAM_API_KEY``,
...), read by the same loader as every command (:mod:`asyncgrpo.config.sources`), so no secret is ever
in argv or in the config text. Each phase before the first step prints a line, and each
optimizer step one progress line (:mod:`asyncgrpo.run.progress`) for the launcher.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from asyncgrpo.config.launch import CONFIG_ENV
from asyncgrpo.errors import ConfigError

PROG = "python -m asyncgrpo.run.job"


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None):
    """The run's config: ``$ASYNCGRPO_CONFIG``, then ``ASYNCGRPO_*`` variables, then ``argv``'s
    overrides (:meth:`~asyncgrpo.config.training.TrainingConfig.from_yaml_text`)."""
    from asyncgrpo.config.training import TrainingConfig

    environ = os.environ if environ is None else environ
    text = environ.get(CONFIG_ENV)
    if not text:
        raise ConfigError(f"${CONFIG_ENV} is empty: the launcher passes the run's config there")
    return TrainingConfig.from_yaml_text(text, f"${CONFIG_ENV}", argv, environ)


async def train(cfg) -> None:
    from asyncgrpo.evaluation.records import read_evals
    from asyncgrpo.run.progress import JobLines, result_line
    from asyncgrpo.run.training import run_training
    from asyncgrpo.vllm.api import served_name

    result = await run_training(cfg, progress=JobLines(cfg.trainer.max_steps))
    final = served_name(result.adapter_prefix, result.final_version)
    print(
        f"trained {result.steps} steps; final adapter {final} in {result.transport_url}", flush=True
    )
    # the launcher's summary: the same as `asyncgrpo train`'s
    print(result_line(result, read_evals(result.run_dir)), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from asyncgrpo.config.flags import ConfigParser
    from asyncgrpo.console import parse_command_line, plain_help, run_async, run_command
    from asyncgrpo.errors import DEBUG_HELP

    parser = ConfigParser(
        prog=PROG,
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", default=[], help="section.field=value overrides")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    args = parse_command_line(lambda: parser.parse_args(argv), PROG)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: run_async(train, load_config(args.overrides)), PROG, debug=args.debug)


if __name__ == "__main__":
    main()

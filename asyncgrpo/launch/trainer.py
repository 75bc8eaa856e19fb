"""``python -m asyncgrpo.launch.trainer [section.field=value ...]``: the trainer job of a launch.

``asyncgrpo train`` for a machine that has no copy of the config file: the config arrives as
YAML in ``$ASYNCGRPO_CONFIG`` (the launcher strips secrets from it), the replicas' URLs as
overrides on the command line, and the bearer token for the replicas by the *name* of an
environment variable (``--upstream-key-env HF_TOKEN``), so no secret is ever in argv. Each
optimizer step prints one progress line (:mod:`asyncgrpo.launch.progress`) for the launcher.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Sequence

import yaml

from asyncgrpo.errors import ConfigError

CONFIG_ENV = "ASYNCGRPO_CONFIG"


def load_config(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None):
    """The run's config from ``$ASYNCGRPO_CONFIG`` plus the command line's overrides."""
    from asyncgrpo.config import ENV_PREFIX, TrainingConfig
    from asyncgrpo.settings import env_overrides

    environ = dict(os.environ if environ is None else environ)
    p = argparse.ArgumentParser(prog="python -m asyncgrpo.launch.trainer", description=__doc__)
    p.add_argument("--upstream-key-env", default=None,
                   help="environment variable holding the bearer token sent to the replicas")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="section.field=value overrides")
    args = p.parse_args(argv)
    text = environ.get(CONFIG_ENV)
    if not text:
        raise ConfigError(f"${CONFIG_ENV} is empty: the launcher passes the run's config there")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError(f"${CONFIG_ENV} must hold a YAML mapping of sections")
    # Secrets (a transport URL with credentials) arrive as ASYNCGRPO_* variables, as everywhere.
    data = env_overrides(TrainingConfig, data, ENV_PREFIX, environ)
    cfg = TrainingConfig.from_dict(data, args.overrides)
    if args.upstream_key_env:
        token = environ.get(args.upstream_key_env)
        if not token:
            raise ConfigError(f"--upstream-key-env {args.upstream_key_env}: the variable is unset")
        cfg.proxy = dataclasses.replace(cfg.proxy, upstream_api_key=token)
    return cfg


async def train(cfg) -> None:
    from asyncgrpo.launch.progress import progress_line
    from asyncgrpo.run import run_training

    def progress(step: int, metrics: dict[str, float]) -> None:
        print(progress_line(step, cfg.trainer.max_steps, metrics), flush=True)

    result = await run_training(cfg, progress=progress)
    print(f"trained {result.steps} steps; final adapter {result.adapter_prefix}-v"
          f"{result.final_version} in {result.transport_url}", flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    from asyncgrpo.cli import _run, run_and_exit

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_and_exit(lambda: _run(train, load_config(argv)), "python -m asyncgrpo.launch.trainer")


if __name__ == "__main__":
    main()

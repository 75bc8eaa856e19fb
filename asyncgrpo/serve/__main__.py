"""``python -m asyncgrpo.serve --model DIR --replicas N``: run local vLLM replicas until interrupted.

Every ``ServeConfig`` field is a flag (``--help``) and an ``ASYNCGRPO_SERVE_<FIELD>``
environment variable; the API key only comes from the environment. Prints one line per replica
with its URL once every replica is healthy; SIGINT or SIGTERM stops all of them (whole process
trees).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from asyncgrpo.console import run_async, run_command
from asyncgrpo.errors import ConfigError
from asyncgrpo.serve.config import ServeConfig
from asyncgrpo.serve.replicas import launch_replicas
from asyncgrpo.settings import exit_on_config_error, parse_args

PROG = "python -m asyncgrpo.serve"
ENV_PREFIX = "ASYNCGRPO_SERVE_"


def parse(argv: Sequence[str] | None = None) -> ServeConfig:
    """The config; a bad value exits with status 2 and one line."""
    return _parse(argv)[0]


def _parse(argv: Sequence[str] | None) -> tuple[ServeConfig, bool]:
    """The config and ``--debug``."""
    config, args = parse_args(
        ServeConfig, argv, prog=PROG, description=__doc__, env_prefix=ENV_PREFIX
    )
    if config.replicas < 1:
        exit_on_config_error(PROG, ConfigError(f"--replicas={config.replicas}: start 1 or more"))
    return config, args.debug


async def _serve(config: ServeConfig) -> None:
    async with launch_replicas(config) as replicas:
        for r in replicas:
            print(f"replica {r.index} ready: {r.url} (pid {r.pid}, log {r.log_path}, "
                  f"{r.started_s:.1f} s)", flush=True)  # fmt: skip
        await anyio.sleep_forever()


def main(argv: Sequence[str] | None = None) -> None:
    config, debug = _parse(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: _until_stopped(config), PROG, debug=debug)


def _until_stopped(config: ServeConfig) -> None:
    try:
        run_async(_serve, config)
    except KeyboardInterrupt:
        pass  # SIGINT or SIGTERM is how a server is stopped: status 0


if __name__ == "__main__":
    main()

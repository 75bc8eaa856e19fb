"""``python -m asyncgrpo.tinker --model DIR [--port P]``: the Tinker-compatible service.

Every ``TinkerConfig`` field is a flag (``--help``) and an ``ASYNCGRPO_TINKER_<FIELD>``
environment variable; the API key comes only from the environment (``TINKER_API_KEY``, the
variable the SDK reads too, or the one ``--api-key-env`` names). Prints
``tinker service ready: http://HOST:PORT`` once it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import Sequence

from asyncgrpo.config.flags import parse_args
from asyncgrpo.console import parse_command_line, run_command
from asyncgrpo.tinker.config import API_KEY_ENV, TinkerConfig

PROG = "python -m asyncgrpo.tinker"
ENV_PREFIX = "ASYNCGRPO_TINKER_"


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper
    )


def _parse(argv: Sequence[str] | None, prog: str) -> tuple[TinkerConfig, argparse.Namespace]:
    config, args = parse_args(
        TinkerConfig,
        argv,
        prog=prog,
        description="A REST server speaking the tinker SDK's API over asyncgrpo's trainer.",
        env_prefix=ENV_PREFIX,
        extra=_extra,
    )
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config = dataclasses.replace(config, api_key=os.environ[API_KEY_ENV])
    return config, args


async def _serve(config: TinkerConfig) -> None:
    from asyncgrpo.tinker.server import serve_tinker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_tinker(config) as url:
        print(f"tinker service ready: {url}", flush=True)
        await stop.wait()
    print("tinker service stopped", flush=True)


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Serve until SIGINT/SIGTERM (status 0); a bad flag or a busy port is one line."""
    config, args = parse_command_line(lambda: _parse(argv, prog), prog)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: asyncio.run(_serve(config)), prog, debug=args.debug)


if __name__ == "__main__":
    main()

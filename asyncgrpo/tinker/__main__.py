"""``python -m asyncgrpo.tinker --model DIR [--port P]``: the Tinker-compatible service.

Every ``TinkerConfig`` field is a flag (``--help``) and an ``ASYNCGRPO_TINKER_<FIELD>``
environment variable; the API key comes only from the environment (``TINKER_API_KEY``, the
variable the SDK reads too, or the one ``--api-key-env`` names). Prints
``tinker service ready: http://HOST:PORT`` once it answers. Under ``torchrun --nproc-per-node
N`` rank 0 serves and every rank computes a share of each step (:mod:`asyncgrpo.tinker.ranks`).
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
from asyncgrpo.config.tinker import API_KEY_ENV, TinkerConfig
from asyncgrpo.console import parse_command_line, run_command

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


async def _serve(config: TinkerConfig, dp: object = None) -> None:
    from asyncgrpo.tinker.server import serve_tinker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_tinker(config, dp) as url:  # type: ignore[arg-type]
        print(f"tinker service ready: {url}", flush=True)
        await stop.wait()
    print("tinker service stopped", flush=True)


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> None:
    """Serve until SIGINT/SIGTERM (status 0); a bad flag or a busy port is one line."""
    config, args = parse_command_line(lambda: _parse(argv, prog), prog)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: _rank_main(config), prog, debug=args.debug)


def _rank_main(config: TinkerConfig) -> None:
    """One process: the service. Under torchrun rank 0 serves and the other ranks follow it,
    ignoring SIGINT/SIGTERM: they exit when rank 0 tells them to or is gone."""
    from asyncgrpo.trainer.distributed import DataParallel

    dp = DataParallel.from_env(
        timeout_s=config.dp_timeout_s,
        timeout_setting="tinker.dp_timeout_s",
        aftermath="The service stops; start it again",
    )
    try:
        if dp is None or dp.is_main:
            asyncio.run(_serve(config, dp))
            return
        from asyncgrpo.tinker.ranks import follow
        from asyncgrpo.tinker.server import load_engine

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        follow(load_engine(config, dp), dp)
    finally:
        if dp is not None:
            dp.close()


if __name__ == "__main__":
    main()

"""``python -m asyncgrpo.proxy --upstream URL --upstream URL [--host H --port P ...]``.

Every ``ProxyConfig`` field is a flag (``--help``) and an ``ASYNCGRPO_PROXY_<FIELD>``
environment variable. Secrets come only from the environment (``ASYNCGRPO_PROXY_API_KEY``, or the
variable ``--api-key-env`` / ``--upstream-api-key-env`` names), never from the command line,
where ``ps`` would show them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence

from asyncgrpo.config.flags import parse_args
from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.console import parse_command_line, run_command
from asyncgrpo.errors import UsageError
from asyncgrpo.proxy.server import serve_proxy

PROG = "python -m asyncgrpo.proxy"
ENV_PREFIX = "ASYNCGRPO_PROXY_"


def _log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper
    )


def parse(argv: Sequence[str] | None = None) -> tuple[ProxyConfig, str]:
    """The config and the log level; a bad value raises :class:`~asyncgrpo.errors.UsageError`."""
    config, args = _parse(argv)
    return config, args.log_level


def _parse(argv: Sequence[str] | None) -> tuple[ProxyConfig, argparse.Namespace]:
    config, args = parse_args(
        ProxyConfig,
        argv,
        prog=PROG,
        description="One OpenAI-compatible endpoint in front of many vLLM replicas.",
        env_prefix=ENV_PREFIX,
        extra=_log_level,
    )
    if not config.upstreams:
        raise UsageError("give at least one --upstream URL", prog=PROG, debug=args.debug)
    return config, args


async def _serve(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_proxy(config) as url:
        print(f"asyncgrpo proxy on {url} -> {', '.join(config.upstreams)}", flush=True)
        await stop.wait()
    print("asyncgrpo proxy stopped", flush=True)


def _run(config: ProxyConfig) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (status 0); a start-up failure (a busy port) is one line."""
    config, args = parse_command_line(lambda: _parse(argv), PROG)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: _run(config), PROG, debug=args.debug)


if __name__ == "__main__":
    main()

"""``python -m asyncgrpo.proxy --upstream URL --upstream URL [--host H --port P ...]``.

Secrets come from environment variables (``--api-key-env``, ``--upstream-api-key-env``), never
from the command line, where ``ps`` would show them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence

from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy.config import ProxyConfig
from asyncgrpo.proxy.front import serve_proxy

_SECRET = {"api_key", "upstream_api_key"}
_LISTS = {"upstreams": "--upstream", "lora_roots": "--lora-root"}


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    parser = argparse.ArgumentParser(
        prog="python -m asyncgrpo.proxy",
        description="One OpenAI-compatible endpoint in front of many vLLM replicas.",
    )
    for f in dataclasses.fields(ProxyConfig):
        if f.name in _SECRET:
            continue
        help_ = f.metadata.get("help", "")
        if f.name in _LISTS:
            parser.add_argument(_LISTS[f.name], dest=f.name, action="append", help=help_)
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = {
            "port": int,
            "imbalance": int,
            "max_tracked_blocks": int,
            "max_body_bytes": int,
            "max_attempts": int,
            "health_timeouts_to_open": int,
            "block_size": int,
        }.get(f.name)
        if kind is None:
            kind = float if f.name.endswith("_s") else str
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_)
    parser.add_argument(
        "--api-key-env",
        default="ASYNCGRPO_PROXY_API_KEY",
        help="Environment variable holding the key clients must send (default %(default)s).",
    )
    parser.add_argument(
        "--upstream-api-key-env",
        default=None,
        help="Environment variable holding the bearer token sent upstream, e.g. HF_TOKEN.",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ProxyConfig)
        if f.name not in _SECRET and getattr(args, f.name) is not None
    }
    for key in _LISTS:
        if key in values:
            values[key] = tuple(values[key])
    values["api_key"] = os.environ.get(args.api_key_env) or None
    if args.upstream_api_key_env:
        token = os.environ.get(args.upstream_api_key_env)
        if not token:
            parser.error(f"--upstream-api-key-env {args.upstream_api_key_env} is not set")
        values["upstream_api_key"] = token
    return ProxyConfig(**values)


async def _serve(config: ProxyConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with serve_proxy(config) as url:
        print(f"asyncgrpo proxy on {url} -> {', '.join(config.upstreams)}", flush=True)
        await stop.wait()
    print("asyncgrpo proxy stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ConfigError as exc:
        sys.exit(f"error: {exc}")
    if not config.upstreams:
        sys.exit("error: give at least one --upstream URL")
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))


if __name__ == "__main__":
    main()

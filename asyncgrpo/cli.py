"""The ``asyncgrpo`` command: ``demo``, ``plot`` (and, as they land, ``train`` and ``rollout``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from asyncgrpo.errors import AsyncGRPOError


def _demo(args: argparse.Namespace) -> None:
    import anyio

    from asyncgrpo.demo import run_demo

    anyio.run(run_demo, Path(args.output_dir), args.replicas)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the tiny CPU demo end to end")
    demo.add_argument(
        "--output-dir", default="runs/demo", help="where the model, logs and results go"
    )
    demo.add_argument("--replicas", type=int, default=2, help="local vLLM replicas to start")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.func(args)
    except AsyncGRPOError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()

"""``asyncgrpo export SOURCE DIR [--version N]``: a published adapter version as a plain PEFT
directory.

``SOURCE`` is a run directory (``<output_dir>/<run_name>``, whose transport is its ``store``
directory), or the transport URL of a run that stored its versions elsewhere (``s3://...``). The
adapter's name comes from the run's ``policy.json`` (or ``--name``), the version is the newest
published one (or ``--version``). The files are fetched and verified like a replica's, then
written to ``DIR`` without asyncgrpo's manifest: ``PeftModel.from_pretrained(base, DIR)`` and
``vllm serve BASE --enable-lora --lora-modules NAME=DIR`` load it as it is.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from asyncgrpo.config.flags import int_in
from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound
from asyncgrpo.vllm.api import MAX_VERSION

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def source_url(source: str) -> str:
    """The transport URL of ``source``: a URL as given, or a run directory's (or a transport
    directory's) local path."""
    if _URL.match(source):
        return source
    path = Path(source).expanduser()
    for candidate in (path / "store", path):
        if (candidate / "run.json").is_file():
            return str(candidate.resolve())
    raise ConfigError(
        f"{source}: no run here (neither {path / 'store' / 'run.json'} nor {path / 'run.json'}); "
        "give a run directory (<output_dir>/<run_name>) or its transport URL"
    )


async def export(source: str, dest: str, *, version: int | None, name: str | None) -> str:
    """Export one version of the run at ``source`` to ``dest``; the line to print."""
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.store.run_documents import RunStore
    from asyncgrpo.transport import open_transport
    from asyncgrpo.vllm.api import parse_served_name

    async with open_transport(source_url(source)) as transport:
        if name is None:
            try:
                served, _ = await RunStore(transport).read_policy()
            except NotFound:
                raise ConfigError(
                    f"{source}: the run has published no adapter yet (no policy.json)"
                ) from None
            parsed = parse_served_name(served)
            if parsed is None:
                raise ConfigError(f"{source}: policy.json names {served!r}, not a version")
            name = parsed[0]
        store = AdapterStore(transport)
        if version is None:
            version = await store.latest(name)
            if version is None:
                raise ConfigError(f"{source}: no published version of adapter {name}")
        try:
            path = await store.export(name, version, dest)
        except (AlreadyExists, NotFound) as exc:  # the caller's choice of DIR or --version
            raise ConfigError(str(exc)) from None
    return f"exported {name} version {version} to {path} (a PEFT adapter directory)"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a published adapter version as a PEFT directory")
    p.add_argument("source", help="run directory (<output_dir>/<run_name>) or transport URL")
    p.add_argument("dest", help="directory to create (absent or empty)")
    p.add_argument("--version", type=int_in(0, MAX_VERSION), default=None,
                   help="version (default: the newest)")  # fmt: skip
    p.add_argument("--name", default=None, help="adapter name (default: the run's, policy.json)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> None:
    from asyncgrpo.console import run_async

    print(run_async(lambda: export(args.source, args.dest, version=args.version, name=args.name)))

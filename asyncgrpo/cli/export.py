"""``asyncgrpo export SOURCE DIR [--version N]``: a published adapter version as a plain PEFT
directory.

``SOURCE`` is a run directory (``<output_dir>/<run_name>``, whose transport is its ``store``
directory), or the transport URL of a run that stored its versions elsewhere (``s3://...``). The
adapter's name comes from the run's ``policy.json`` (or ``--name``), the version is the newest
published one (or ``--version``). The files are fetched and verified like a replica's, then
written to ``DIR`` without asyncgrpo's manifest: ``PeftModel.from_pretrained(base, DIR)`` and
``vllm serve BASE --enable-lora --lora-modules NAME=DIR`` load it as it is.

Its ``adapter_config.json`` names the base model portably (``--base-model``): the model's name
(a Hub id as it is; a local model directory by its name, not this machine's absolute path), or
the model's path relative to ``DIR``, or the value given.
"""

from __future__ import annotations

import argparse
import json
import os
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


#: ``--base-model`` choices besides a literal value.
BASE_MODEL_MODES = ("name", "relative", "as-trained")
CONFIG_FILE = "adapter_config.json"


def portable_base(trained: str, mode: str, dest: Path) -> str:
    """What the exported adapter names as its base, from what it was trained on: ``name``
    (a Hub id kept; a local path's last part), ``relative`` (a local path relative to
    ``dest``), ``as-trained`` (unchanged), or ``mode`` itself (any other value)."""
    local = os.path.isabs(trained) or os.path.exists(trained)
    if mode == "as-trained" or (mode in BASE_MODEL_MODES and not local):
        return trained
    if mode == "name":
        return Path(trained).name
    if mode == "relative":
        return os.path.relpath(Path(trained).resolve(), dest.resolve())
    return mode


def _rename_base(dest: Path, mode: str) -> str | None:
    """Rewrite ``dest``'s adapter config to name its base by ``mode``; the name written."""
    path = dest / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not a PEFT LoRA directory asyncgrpo wrote: left as it is
    trained = config.get("base_model_name_or_path")
    if not isinstance(trained, str):
        return None
    config["base_model_name_or_path"] = portable_base(trained, mode, dest)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return str(config["base_model_name_or_path"])


async def export(
    source: str, dest: str, *, version: int | None, name: str | None, base_model: str = "name"
) -> str:
    """Export one version of the run at ``source`` to ``dest``, naming its base model by
    ``base_model`` (:func:`portable_base`); the line to print."""
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
    base = _rename_base(Path(path), base_model)
    named = f"; its base model: {base}" if base is not None else ""
    return f"exported {name} version {version} to {path} (a PEFT adapter directory{named})"


def add_parser(sub: Any) -> None:
    from asyncgrpo.cli.help import add_command

    p = add_command(
        sub,
        "export",
        help="write a published adapter version as a PEFT directory",
        description=__doc__ or "",
        examples=[
            (
                "asyncgrpo export runs/tiny-cpu exported/tiny-cpu",
                "the newest version of the run in runs/tiny-cpu",
            ),
            (
                "asyncgrpo export runs/tiny-cpu exported/tiny-cpu-v1 --version 1 "
                "--base-model relative",
                "version 1, naming the base model by its path relative to exported/tiny-cpu-v1",
            ),
        ],
    )
    p.add_argument("source", help="run directory (<output_dir>/<run_name>) or transport URL")
    p.add_argument("dest", help="directory to create (absent or empty)")
    p.add_argument(
        "--version", type=int_in(0, MAX_VERSION), default=None, help="version (default: the newest)"
    )
    p.add_argument("--name", default=None, help="adapter name (default: the run's, policy.json)")
    p.add_argument(
        "--base-model",
        default="name",
        metavar="name|relative|as-trained|VALUE",
        help="how adapter_config.json names the base model: name (default: a Hub id "
        "as it is, a local model directory by its name), relative (its path relative "
        "to DIR), as-trained (the path it was trained from), or VALUE itself",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> None:
    from asyncgrpo.console import run_async

    print(
        run_async(
            lambda: export(
                args.source,
                args.dest,
                version=args.version,
                name=args.name,
                base_model=args.base_model,
            )
        )
    )

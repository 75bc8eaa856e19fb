"""Every path in a run's config, made absolute once, where the config is loaded.

A relative path means "from the directory the command was typed in", but a config travels: the
local launch backend runs each job in a directory of its own, and a sweep builds one config per
point from the loaded one. Resolved at load time, every later reader (a backend, a sweep point,
a launched job) sees the path the user meant, and none re-interprets it. What only names a path
when it exists here (``model``, ``dataset.path``: else a Hugging Face id or a ``datasets`` name,
decided by :func:`asyncgrpo.config.model_source.local_path`) is kept as typed when it does not,
so the model check still quotes it; a URL (``s3://...``, ``file:///...``) is not a path.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from asyncgrpo.config.fields import init_fields
from asyncgrpo.config.model_source import local_path
from asyncgrpo.errors import ConfigError

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: (section or None for the top level, key): always a path on this host when set.
DIRECTORIES = ((None, "output_dir"), ("serve", "log_dir"), ("serve", "adapter_cache_dir"))
#: Paths only when they exist here.
WHEN_LOCAL = ((None, "model"), ("dataset", "path"))


def absolute(path: str, cwd: Path) -> str:
    """``path`` (``~`` expanded) from ``cwd``, normalised; an absolute one only normalised."""
    return os.path.normpath(cwd / Path(path).expanduser())


def resolve_paths(cls: type, data: dict[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """A copy of mapping ``data`` for config ``cls`` (a ``TrainingConfig``) with its paths
    absolute from ``cwd`` (default: the current directory): the directories (a default one
    too), ``model`` and ``dataset.path`` when they exist here, and ``transport_url`` when it is
    a plain path. Other values, and values of the wrong type (the loader then reports them),
    are kept as they are."""
    cwd = Path.cwd() if cwd is None else cwd
    data = copy.deepcopy(data)
    for section, key in DIRECTORIES + WHEN_LOCAL + ((None, "transport_url"),):
        node = data if section is None else data.get(section)
        if section is None and key not in data and (default := _default(cls, key)):
            data[key] = default  # a default directory is relative too
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value:
            continue
        if (section, key) in WHEN_LOCAL:
            found = local_path(value, cwd)
            if found is not None:
                node[key] = str(found)
        elif key != "transport_url" or not _URL.match(value):
            node[key] = absolute(value, cwd)
    return data


def _default(cls: type, key: str) -> str | None:
    """The default of ``cls``'s top-level field ``key`` when it is a path (a directory left
    unset is resolved too, so a config and its ``to_dict`` load back equal)."""
    default = init_fields(cls)[key].default
    return default if isinstance(default, str) and default else None


def _unwritable(path: Path, setting: str, exc: OSError, where: Path) -> ConfigError:
    return ConfigError(
        f"{setting}: cannot create or write {path} (making a directory in {where}: "
        f"{exc.strerror or exc}); choose a directory this user can write"
    )


def writable_dir(path: Path, setting: str) -> Path:
    """``path``, created if missing; :class:`ConfigError` naming ``setting`` (``output_dir=
    /proc/runs``) and the reason when it cannot be: no such parent, a read-only mount, no
    permission, a file in the way."""
    check_writable(path, setting)
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=path))  # root passes os.access
    except OSError as exc:
        raise _unwritable(path, setting, exc, path) from None
    return path


def check_writable(path: Path, setting: str) -> None:
    """That ``path`` could be created and written, without creating it: a directory made and
    removed at once in its nearest existing ancestor (a dry run leaves nothing behind)."""
    ancestor = path
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(ancestor))
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=ancestor))
    except OSError as exc:
        raise _unwritable(path, setting, exc, ancestor) from None

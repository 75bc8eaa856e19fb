"""Where settings come from besides defaults: YAML text, ``section.field=value`` overrides and
``PREFIX_SECTION__FIELD`` environment variables.

Each source yields plain data for :func:`asyncgrpo.config.coerce.config_from_dict`; a value
typed as text (an override, a variable) is parsed by its field's annotation and checked at once,
so the error names what the user typed. Secrets come only from the environment: a secret field
set by an override (a command line, which ``ps`` and shell history show) or in a config file
(files get committed, copied, shipped) is refused, naming the variable to use instead, and a
secret's value never appears in an error message.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.config.coerce import coerce_field
from asyncgrpo.config.fields import (
    init_fields,
    is_secret,
    leaf_keys,
    strip_none,
    type_hints,
    unknown_key,
)
from asyncgrpo.config.text import one_line, parse_text
from asyncgrpo.errors import ConfigError


def _section(cls: type, data: dict[str, Any], parts: list[str], label: str) -> tuple[type, dict]:
    """The dataclass and the mapping in ``data`` that hold the last of ``parts`` (a dotted key),
    made as needed; an unknown key on the way is refused."""
    target: Any = cls
    node = data
    for depth, part in enumerate(parts[:-1]):
        where = "".join(p + "." for p in parts[:depth])
        fields = init_fields(target)
        if part not in fields:
            raise unknown_key(where, part, target)
        tp = strip_none(type_hints(target)[part])  # an optional section (eval: None) too
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{label}: {where}{part} has no fields")
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{label}: {where}{part} is not a section")
        node, target = child, tp
    return target, node


def set_key(
    cls: type,
    data: dict[str, Any],
    key: str,
    value: str | list[str],
    label: str,
    *,
    secret_from: str | None = None,
) -> None:
    """Set dotted ``key`` in ``data``; ``value`` is text (parsed by the field's type) or a list
    of texts for a list field. ``label`` is what the user typed, for error messages.

    ``secret_from``: the environment variable a secret field must come from instead; given,
    setting a secret field is refused naming it (the value came from a command line)."""
    parts = key.split(".")
    target, node = _section(cls, data, parts, label)
    part = parts[-1]
    where = "".join(p + "." for p in parts[:-1])
    fields = init_fields(target)
    if part not in fields:
        raise unknown_key(where, part, target)
    tp = type_hints(target)[part]
    if is_secret(fields[part]) and secret_from is not None:
        raise ConfigError(
            f"{label} is a secret: set it in the environment as {secret_from}, not on the "
            "command line (where `ps` and shell history show it)"
        )
    if isinstance(value, list):
        item = (typing.get_args(strip_none(tp)) or (Any,))[0]
        node[part] = [parse_text(v, item, label) for v in value]
    else:
        node[part] = parse_text(value, tp, label)
    if not dataclasses.is_dataclass(tp):  # check now: the error names what the user typed
        coerce_field(fields[part], node[part], tp, label)


def apply_overrides(
    cls: type, data: dict[str, Any], overrides: Sequence[str], *, env_prefix: str = ""
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a copy of ``data``; values are typed by ``cls``'s fields.

    A secret field is refused, naming its ``env_prefix`` variable: overrides come from a
    command line, which other users and shell history can read."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as section.field=value")
        set_key(cls, data, key, text, key, secret_from=env_name(env_prefix, key))
    return data


def refuse_file_secrets(
    cls: type, data: Mapping[str, Any], source: str, *, env_prefix: str, where: str = ""
) -> None:
    """Refuse a secret field set in a config file (files get committed, copied, shipped),
    naming the environment variable to use instead."""
    hints = type_hints(cls)
    for name, f in init_fields(cls).items():
        value = data.get(name) if isinstance(data, Mapping) else None
        if value in (None, "", {}):
            continue
        if is_secret(f):
            raise ConfigError(
                f"{source} sets {where}{name}, a secret: remove it there and set "
                f"{env_name(env_prefix, where + name)} in the environment"
            )
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, Mapping):
            refuse_file_secrets(
                hints[name], value, source, env_prefix=env_prefix, where=f"{where}{name}."
            )


def env_name(prefix: str, key: str) -> str:
    """``ASYNCGRPO_PROXY_`` + ``api_key`` -> ``ASYNCGRPO_PROXY_API_KEY``; a section is ``__``."""
    return prefix + key.replace(".", "__").upper()


def env_overrides(
    cls: type, data: dict[str, Any], prefix: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``data`` with every field whose ``PREFIX_FIELD`` variable is set (non-empty) replaced.

    A list field takes a comma-separated value; secrets come this way too. A set variable
    ``PREFIX_SECTION__NAME`` of a section that has no field ``NAME`` is refused like a misspelt
    key (a config without sections shares its prefix with other variables, so is not checked).
    """
    environ = os.environ if environ is None else environ
    data = copy.deepcopy(data)
    for key, _ in leaf_keys(cls):
        name = env_name(prefix, key)
        if environ.get(name):
            set_key(cls, data, key, environ[name], name)
    _refuse_unknown_env(cls, prefix, environ)
    return data


def _refuse_unknown_env(cls: type, prefix: str, environ: Mapping[str, str]) -> None:
    hints = type_hints(cls)
    sections = {
        name.upper(): hints[name]
        for name in init_fields(cls)
        if dataclasses.is_dataclass(hints[name])
    }
    for var in sorted(environ):
        section, sep, field = var.removeprefix(prefix).partition("__")
        if not (var.startswith(prefix) and sep and environ[var]) or section not in sections:
            continue
        if field not in {n.upper() for n in init_fields(sections[section])}:
            where = f"{section.lower()}."
            raise _unknown_env(var, prefix, where, field.lower(), sections[section])


def _unknown_env(var: str, prefix: str, where: str, key: str, cls: type) -> ConfigError:
    """:func:`unknown_key`'s message, the close match spelt as the variable to set."""
    error = unknown_key(where, key, cls, spell=lambda k: env_name(prefix, where + k))
    return ConfigError(f"{var} is set, but {error}")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (empty file: ``{}``)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    return parse_yaml(text, f"config file {path}")


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """YAML text whose top level is a mapping (empty: ``{}``); ``source`` names it in errors."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {one_line(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of fields")
    return data

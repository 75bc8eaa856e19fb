"""A config dataclass as a command line: one ``argparse`` flag per field.

``--field-name``; a repeatable singular flag for a tuple or list (``upstreams`` ->
``--upstream``); ``--x`` / ``--no-x`` for a bool; the choices of a ``Literal``; secrets
(``metadata["secret"]``) only through an environment variable, named by ``--field-env``, never
argv. Precedence: field defaults < ``--config`` YAML < environment < flags. The help of a field
is its attribute docstring.

Nothing here exits the process: a bad command line raises :class:`~asyncgrpo.errors.UsageError`
(a :class:`~asyncgrpo.errors.ConfigError` naming the command), which the command's ``main``
reports as one line with status 2 (:func:`asyncgrpo.console.parse_command_line`). Only
argparse's own ``--help`` ends the parse (``SystemExit(0)``), as it does for every argparse CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, TypeVar

from asyncgrpo.config.coerce import config_from_dict, to_dict
from asyncgrpo.config.fields import field_docs, init_fields, is_list, strip_none, type_hints
from asyncgrpo.config.sources import (
    env_name,
    env_overrides,
    read_yaml,
    refuse_file_secrets,
    set_key,
)
from asyncgrpo.errors import DEBUG_HELP, ConfigError, UsageError

T = TypeVar("T")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type`` for a command's own number: an integer from ``low`` to ``high``,
    else argparse's one-line error naming the range (a value of more digits than ``high`` has
    is refused before any ``int()``)."""

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        shown = text if len(text) <= 40 else text[:40] + "..."
        if digits.isascii() and digits.isdigit() and len(digits) > len(str(high)) + 1:
            raise argparse.ArgumentTypeError(f"{shown}: must be from {low} to {high}")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{shown!r}: expected an integer from {low} to {high}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value}: must be from {low} to {high}")
        return value

    return parse


class ConfigParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors raise :class:`UsageError` (one line, no usage dump)
    instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog)


def flag_name(f: dataclasses.Field, tp: Any) -> str:
    """``--field-name``; a list field gets the singular (``upstreams`` -> ``--upstream``)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    name = f.name.removesuffix("s") if is_list(tp) else f.name
    return "--" + name.replace("_", "-")


def _help(cls: type, f: dataclasses.Field, extra: str = "") -> str:
    text = field_docs(cls).get(f.name, "")
    if f.default is not dataclasses.MISSING and f.default not in (None, (), "") and not extra:
        extra = f" (default: {to_dict(f.default)})"
    return (text + extra).replace("%", "%%")


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_fields(parser: argparse.ArgumentParser, cls: type, *, env_prefix: str) -> None:
    """One flag per field of flat dataclass ``cls``; values stay text until ``parse_args``."""
    hints = type_hints(cls)
    for name, f in init_fields(cls).items():
        tp = hints[name]
        flag = flag_name(f, tp)
        if f.metadata.get("cli") is False:
            continue
        if f.metadata.get("secret"):
            default = env_name(env_prefix, name)
            parser.add_argument(
                flag + "-env",
                dest=f"{name}__env",
                metavar="VAR",
                default=None,
                help=_help(
                    cls,
                    f,
                    f" Read from this environment variable (default {default}); "
                    "never given on the command line.",
                ),
            )
        elif f.metadata.get("argv_rest"):
            parser.add_argument(name, nargs=argparse.REMAINDER, help=_help(cls, f))
        elif is_list(tp):
            parser.add_argument(
                flag, dest=name, action="append", metavar="VALUE", help=_help(cls, f)
            )
        elif strip_none(tp) is bool:
            parser.add_argument(flag, dest=name, nargs="?", const="true", help=_help(cls, f))
            parser.add_argument(
                "--no-" + flag[2:],
                dest=name,
                action="store_const",
                const="false",
                help=f"Same as {flag}=false.",
            )
        else:
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            metavar = _METAVARS.get(strip_none(tp), "VALUE")
            parser.add_argument(
                flag,
                dest=name,
                help=_help(cls, f),
                metavar="{" + ",".join(map(str, choices)) + "}" if choices else metavar,
            )


def parse_args(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None,
    env_prefix: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[T, argparse.Namespace]:
    """Parse ``argv`` into ``cls`` (see the module docstring); a bad command line, variable or
    file raises :class:`UsageError` naming ``prog``.

    ``extra`` adds flags that are not config fields (e.g. ``--log-level``); the namespace is
    returned for them.
    """
    parser = ConfigParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", metavar="YAML", help="A YAML mapping of these settings; env and flags win."
    )
    add_fields(parser, cls, env_prefix=env_prefix)
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    try:
        return _from_namespace(cls, args, env_prefix), args
    except ConfigError as exc:
        raise UsageError(str(exc), prog=prog, debug=args.debug) from exc


def _from_namespace(cls: type[T], args: argparse.Namespace, env_prefix: str) -> T:
    data = read_yaml(args.config) if args.config else {}
    refuse_file_secrets(cls, data, f"config file {args.config}", env_prefix=env_prefix)
    data = env_overrides(cls, data, env_prefix)
    hints = type_hints(cls)
    for name, f in init_fields(cls).items():
        tp = hints[name]
        if f.metadata.get("cli") is False:
            continue
        if f.metadata.get("secret"):
            var = getattr(args, f"{name}__env")
            if var is not None:  # named explicitly: it must be set
                if not os.environ.get(var):
                    raise ConfigError(f"{flag_name(f, tp)}-env {var}: that variable is not set")
                data[name] = os.environ[var]
            continue
        value = getattr(args, name, None)
        if f.metadata.get("argv_rest"):
            value = value[1:] if value[:1] == ["--"] else value
            if value:
                data[name] = list(value)
        elif value is not None:
            set_key(cls, data, name, value, flag_name(f, tp))
        if f.metadata.get("required") and not data.get(name):
            raise ConfigError(f"{flag_name(f, tp)} is required: {field_docs(cls).get(name, '')}")
    return config_from_dict(cls, data)

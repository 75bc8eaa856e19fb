"""One way to configure a dataclass: a YAML mapping, environment variables, command-line flags.

Every configuration in asyncgrpo is a keyword-only dataclass: each field is documented by the
string right below it (an attribute docstring, which Sphinx, IDEs, tyro and simple-parsing read
too) and validated in ``__post_init__``. This module derives the rest from those fields, so no
setting is declared twice:

- ``config_from_dict(cls, data)``: a mapping (parsed YAML) to ``cls``, recursing into nested
  dataclass sections, checking every value against its annotation;
- ``apply_overrides(cls, data, ["section.field=value"])``: typed ``key=value`` overrides;
- ``env_overrides(cls, prefix)``: the same from ``PREFIX_FIELD`` (``PREFIX_SECTION__FIELD``)
  environment variables;
- ``parse_args(cls, argv, ...)``: an ``argparse`` CLI with one flag per field: ``--field-name``,
  a repeatable singular flag for a tuple or list (``upstreams`` -> ``--upstream``), ``--x`` /
  ``--no-x`` for a bool, the choices of a ``Literal``; secrets (``metadata["secret"]``) only
  through an environment variable, named by ``--field-env``, never argv;
- ``redacted(obj)`` / ``redacted_repr(obj)``: what may be shown of a config (trackio, logs,
  reprs): secret fields as ``REDACTED``, credentials inside URLs hidden
  (:mod:`asyncgrpo.config.redaction`).

Secrets come only from the environment: a secret field set by an override (``key=value`` on a
command line) or in a config file is refused, naming the variable to use instead, and a
secret's value never appears in an error message.

Precedence: field defaults < ``--config`` YAML < environment < flags. A bad value at any layer
is a :class:`ConfigError` naming what the user typed (the flag, the variable or the key), the
value and the fix; the CLIs print it as one line and exit with status 2.

The help of a field is its attribute docstring (``field_docs``). Field metadata keys: ``flag`` (the flag's name when the derived one does not fit);
``secret``; ``argv_rest`` (the field takes everything after ``--``); ``required`` (a value the
CLI demands though the dataclass has a default); ``cli: False`` (a setting of an enclosing config
only, no flag); ``derived`` (the field is set from another part of
an enclosing config, named there; the enclosing section may not set it itself).

Ranges and choices: each config's ``__post_init__`` calls ``check_fields(self, section,
ge=..., gt=..., le=..., lt=...)`` once, so a field is validated the same way however it was set.

Why home-grown rather than pydantic-settings, tyro, simple-parsing or jsonargparse: see
``docs/config.md`` (in short, the light core stays aiohttp, httptools, anyio and pyyaml).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import inspect
import itertools
import operator
import os
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import yaml

from asyncgrpo.config.redaction import REDACTED, redact_text
from asyncgrpo.console import DEBUG_HELP, fail
from asyncgrpo.errors import ConfigError

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Mapping -> dataclass, with type checks
# ---------------------------------------------------------------------------------------------


def to_dict(obj: Any, *, where: str = "") -> Any:
    """A dataclass as plain YAML-friendly data (tuples become lists) that ``config_from_dict``
    turns back into an equal config (a section's derived fields are left out)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_dict(getattr(obj, f.name), where=f"{where}{f.name}.")
            for f in dataclasses.fields(obj)
            if not _derived(f, where)
        }
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _secret(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("secret"))


def secret_keys(cls: type, where: str = "") -> list[str]:
    """Dotted keys of every secret field of ``cls`` and its sections (``proxy.api_key``)."""
    hints = _hints(cls)
    keys = []
    for name, f in _fields(cls).items():
        if _secret(f):
            keys.append(where + name)
        elif dataclasses.is_dataclass(hints[name]):
            keys += secret_keys(hints[name], f"{where}{name}.")
    return keys


def redacted(obj: Any, *, where: str = "") -> Any:
    """``to_dict(obj)`` fit to show: a set secret field is ``REDACTED``, every string has its
    URL credentials hidden. For trackio, logs and dry runs; not loadable back."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return to_dict(_shown(obj))
    out = {}
    for f in dataclasses.fields(obj):
        if _derived(f, where):
            continue
        value = getattr(obj, f.name)
        hidden = _secret(f) and value
        out[f.name] = REDACTED if hidden else redacted(value, where=f"{where}{f.name}.")
    return out


def redacted_repr(obj: Any) -> str:
    """A dataclass repr that shows no secret: assign it as ``__repr__ = redacted_repr`` in a
    config whose strings may carry credentials (the generated repr would print them)."""
    shown = []
    for f in dataclasses.fields(obj):
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if _secret(f) and value:
            text = repr(REDACTED)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            text = redacted_repr(value)
        else:
            text = repr(_shown(value))
        shown.append(f"{f.name}={text}")
    return f"{type(obj).__name__}({', '.join(shown)})"


def _shown(value: Any) -> Any:
    """``value`` with URL credentials hidden in every string, containers kept as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list | tuple):
        return type(value)(_shown(v) for v in value)
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    return value


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right below it), as one line.

    Read from the source, so the documentation stays next to the field it describes; a class
    whose source is not installed (``.pyc`` only) has none, and its flags then have no help.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
            continue
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _unknown_key(where: str, key: str, cls: type) -> ConfigError:
    """The error for a key ``cls`` lacks: the valid keys, or for a key an earlier release
    accepted (the config's ``retired_keys``), what replaced it."""
    if (retired := getattr(cls, "retired_keys", {}).get(key)) is not None:
        return ConfigError(f"{where + key} was removed: {retired}")
    valid = ", ".join(sorted(n for n, f in _fields(cls).items() if not _derived(f, where)))
    return ConfigError(f"unknown key {where + key!r}; valid keys are: {valid}")


def _derived(f: dataclasses.Field, where: str) -> bool:
    """A ``derived`` field is the enclosing config's to set, so not settable inside a section."""
    return bool(where) and "derived" in f.metadata


def config_from_dict(cls: type[T], data: Any, *, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and value types recursively.

    ``where`` prefixes field names in error messages (``"trainer."``). Unknown keys and values
    of the wrong type raise ``ConfigError``; each dataclass's own ``__post_init__`` then
    validates ranges and combinations.
    """
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where.rstrip('.') or cls.__name__}: expected a mapping of fields, got "
            f"{type(data).__name__}"
        )
    fields = _fields(cls)
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(where, str(key), cls)
        if _derived(fields[key], where):
            raise ConfigError(
                f"{where}{key} is set from {fields[key].metadata['derived']}: remove it and "
                f"set {fields[key].metadata['derived']} instead"
            )
        kwargs[key] = _coerce_field(fields[key], value, hints[key], f"{where}{key}")
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required key(s): {', '.join(where + m for m in missing)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where.rstrip('.') or cls.__name__}: {exc}") from exc


def _coerce_field(f: dataclasses.Field, value: Any, tp: Any, where: str) -> Any:
    """``_coerce``, but a secret's error does not quote the value (it may be the secret)."""
    try:
        return _coerce(value, tp, where)
    except ConfigError:
        if not _secret(f):
            raise
        raise ConfigError(
            f"{where}: expected {_type_name(tp)}, got a {type(value).__name__} (not shown: it "
            "is a secret)"
        ) from None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert lossless cases (int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:  # Optional[X]: X's own message
            return _coerce(value, arms[0], where)
        for arm in arms:
            try:
                return _coerce(value, arm, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}={value!r}: expected {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r}: use one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        return config_from_dict(tp, value, where=f"{where}.")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}={value!r}: expected a list")
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}={value!r}: expected a mapping with string keys")
        item = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, item, f"{where}.{k}") for k, v in value.items()}
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in expected:
        ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ConfigError(f"{where}={value!r}: expected {expected[tp]}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}={value!r}: expected {_type_name(tp)}")


_OPS = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le),
        "lt": ("<", operator.lt)}  # fmt: skip


def check_fields(obj: Any, section: str, **bounds: dict[str, float]) -> None:
    """Check ``obj``'s ``Literal`` fields against their choices, and numbers against ``bounds``.

    ``check_fields(self, "trainer", ge={"max_steps": 1}, gt={"learning_rate": 0})``; ``None``
    (an optional field left unset) passes, and the error then says None is allowed. Called
    from each config's ``__post_init__``, so direct construction is checked like loading.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        choices = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is Literal and getattr(obj, f.name) not in choices:
            raise ConfigError(
                f"{section}.{f.name}={getattr(obj, f.name)!r}: use one of "
                + ", ".join(map(repr, choices))
            )
    for op, fields in bounds.items():
        sign, holds = _OPS[op]
        for name, bound in fields.items():
            value = getattr(obj, name)
            if value is not None and not holds(value, bound):
                unset = ", or None" if type(None) in typing.get_args(hints[name]) else ""
                raise ConfigError(f"{section}.{name}={value!r}: must be {sign} {bound:g}{unset}")


# ---------------------------------------------------------------------------------------------
# Text (a flag, a variable, a key=value) -> value
# ---------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~"}


def parse_text(text: str, tp: Any, where: str) -> Any:
    """Parse a command-line or environment string for a field annotated ``tp``.

    ``_coerce`` then checks the result, so YAML and text give the same errors.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        if text.strip().lower() in _NONE and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return parse_text(text, arms[0], where)
        try:  # several arms (str | list[str]): YAML decides the shape
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ConfigError(f"{where}={text!r}: expected true or false")
    for kind, expected in ((int, "an integer"), (float, "a number")):
        if tp is kind:
            try:
                return kind(text)
            except ValueError:
                raise ConfigError(f"{where}={text!r}: expected {expected}") from None
    if tp is str:
        return text
    if origin is Literal:
        return next((a for a in args if str(a) == text), text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}={text!r}: not valid YAML ({_one_line(exc)})") from exc
    if origin in (list, tuple) and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return value


def _one_line(exc: BaseException | str) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


# ---------------------------------------------------------------------------------------------
# Overrides: key=value strings, environment variables
# ---------------------------------------------------------------------------------------------


def _set(
    cls: type,
    data: dict[str, Any],
    key: str,
    value: Any,
    label: str,
    *,
    secret_from: str | None = None,
) -> None:
    """Set dotted ``key`` in ``data``; ``value`` is text (parsed by the field's type) or a list
    of texts for a list field. ``label`` is what the user typed, for error messages.

    ``secret_from``: the environment variable a secret field must come from instead; given,
    setting a secret field is refused naming it (the value came from a command line)."""
    parts = key.split(".")
    target: Any = cls
    node = data
    for depth, part in enumerate(parts):
        where = "".join(p + "." for p in parts[:depth])
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"{label}: {where.rstrip('.')} has no fields")
        fields = _fields(target)
        if part not in fields:
            raise _unknown_key(where, part, target)
        tp = _hints(target)[part]
        if depth < len(parts) - 1:
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{label}: {where}{part} is not a section")
            node, target = child, _strip_none(tp)  # an optional section (eval: None)
            continue
        if _secret(fields[part]) and secret_from is not None:
            raise ConfigError(
                f"{label} is a secret: set it in the environment as {secret_from}, not on the "
                "command line (where `ps` and shell history show it)"
            )
        if isinstance(value, list):
            item = (typing.get_args(_strip_none(tp)) or (Any,))[0]
            node[part] = [parse_text(v, item, label) for v in value]
        else:
            node[part] = parse_text(value, tp, label)
        if not dataclasses.is_dataclass(tp):  # check now: the error names what the user typed
            _coerce_field(fields[part], node[part], tp, label)


def _strip_none(tp: Any) -> Any:
    if _is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return tp


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
        _set(cls, data, key, text, key, secret_from=env_name(env_prefix, key))
    return data


def refuse_file_secrets(
    cls: type, data: Mapping[str, Any], source: str, *, env_prefix: str, where: str = ""
) -> None:
    """Refuse a secret field set in a config file (files get committed, copied, shipped),
    naming the environment variable to use instead."""
    hints = _hints(cls)
    for name, f in _fields(cls).items():
        value = data.get(name) if isinstance(data, Mapping) else None
        if value in (None, "", {}):
            continue
        if _secret(f):
            raise ConfigError(
                f"{source} sets {where}{name}, a secret: remove it there and set "
                f"{env_name(env_prefix, where + name)} in the environment"
            )
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, Mapping):
            refuse_file_secrets(
                hints[name], value, source, env_prefix=env_prefix, where=f"{where}{name}."
            )


def _leaf_keys(cls: type, where: str = "") -> list[tuple[str, dataclasses.Field]]:
    out = []
    hints = _hints(cls)
    for name, f in _fields(cls).items():
        if _derived(f, where):
            continue
        if dataclasses.is_dataclass(hints[name]):
            out += _leaf_keys(hints[name], f"{where}{name}.")
        else:
            out.append((where + name, f))
    return out


def env_name(prefix: str, key: str) -> str:
    """``ASYNCGRPO_PROXY_`` + ``api_key`` -> ``ASYNCGRPO_PROXY_API_KEY``; a section is ``__``."""
    return prefix + key.replace(".", "__").upper()


def env_overrides(
    cls: type, data: dict[str, Any], prefix: str, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``data`` with every field whose ``PREFIX_FIELD`` variable is set (non-empty) replaced.

    A list field takes a comma-separated value; secrets come this way too.
    """
    environ = os.environ if environ is None else environ
    data = copy.deepcopy(data)
    for key, _ in _leaf_keys(cls):
        name = env_name(prefix, key)
        if environ.get(name):
            _set(cls, data, key, environ[name], name)
    return data


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
        raise ConfigError(f"{source} is not valid YAML: {_one_line(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of fields")
    return data


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


class ConfigParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and exit with status 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, ConfigError(message))


def _is_list(tp: Any) -> bool:
    return typing.get_origin(_strip_none(tp)) in (list, tuple)


def flag_name(f: dataclasses.Field, tp: Any) -> str:
    """``--field-name``; a list field gets the singular (``upstreams`` -> ``--upstream``)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    name = f.name.removesuffix("s") if _is_list(tp) else f.name
    return "--" + name.replace("_", "-")


def _help(cls: type, f: dataclasses.Field, extra: str = "") -> str:
    text = field_docs(cls).get(f.name, "")
    if f.default is not dataclasses.MISSING and f.default not in (None, (), "") and not extra:
        extra = f" (default: {to_dict(f.default)})"
    return (text + extra).replace("%", "%%")


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def add_fields(parser: argparse.ArgumentParser, cls: type, *, env_prefix: str) -> None:
    """One flag per field of flat dataclass ``cls``; values stay text until ``parse_args``."""
    hints = _hints(cls)
    for name, f in _fields(cls).items():
        tp = hints[name]
        flag = flag_name(f, tp)
        if f.metadata.get("cli") is False:
            continue
        if f.metadata.get("secret"):
            default = env_name(env_prefix, name)
            parser.add_argument(
                flag + "-env", dest=f"{name}__env", metavar="VAR", default=None,
                help=_help(cls, f, f" Read from this environment variable (default {default}); "
                           "never given on the command line."),
            )  # fmt: skip
        elif f.metadata.get("argv_rest"):
            parser.add_argument(name, nargs=argparse.REMAINDER, help=_help(cls, f))
        elif _is_list(tp):
            parser.add_argument(
                flag, dest=name, action="append", metavar="VALUE", help=_help(cls, f)
            )
        elif _strip_none(tp) is bool:
            parser.add_argument(flag, dest=name, nargs="?", const="true", help=_help(cls, f))
            parser.add_argument(
                "--no-" + flag[2:], dest=name, action="store_const", const="false",
                help=f"Same as {flag}=false.",
            )  # fmt: skip
        else:
            choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else None
            metavar = _METAVARS.get(_strip_none(tp), "VALUE")
            parser.add_argument(
                flag, dest=name, help=_help(cls, f),
                metavar="{" + ",".join(map(str, choices)) + "}" if choices else metavar,
            )  # fmt: skip


def parse_args(
    cls: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None,
    env_prefix: str,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> tuple[T, argparse.Namespace]:
    """Parse ``argv`` into ``cls`` (see the module docstring); errors exit with status 2.

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
        fail(prog, exc, debug=args.debug)


def _from_namespace(cls: type[T], args: argparse.Namespace, env_prefix: str) -> T:
    data = read_yaml(args.config) if args.config else {}
    refuse_file_secrets(cls, data, f"config file {args.config}", env_prefix=env_prefix)
    data = env_overrides(cls, data, env_prefix)
    hints = _hints(cls)
    for name, f in _fields(cls).items():
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
            _set(cls, data, name, value, flag_name(f, tp))
        if f.metadata.get("required") and not data.get(name):
            raise ConfigError(f"{flag_name(f, tp)} is required: {field_docs(cls).get(name, '')}")
    return config_from_dict(cls, data)


def exit_on_config_error(prog: str, exc: ConfigError) -> NoReturn:
    """The CLIs' answer to a bad setting found after parsing: one line, status 2
    (:func:`asyncgrpo.console.fail`, which reports every command's errors)."""
    fail(prog, exc)

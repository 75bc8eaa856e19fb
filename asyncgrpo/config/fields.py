"""What a config dataclass's fields say: their types, their docstrings, their metadata.

Every configuration is a keyword-only dataclass whose fields carry everything the loader needs;
the helpers here read it, so coercion (:mod:`.coerce`), the sources (:mod:`.sources`), the flags
(:mod:`.flags`) and redaction agree on what a field is. Field metadata keys: ``flag`` (the flag's name when the
derived one does not fit); ``secret`` (only from the environment, shown as ``REDACTED``);
``argv_rest`` (the field takes everything after ``--``); ``required`` (a value the CLI demands
though the dataclass has a default); ``cli: False`` (a setting of an enclosing config only, no
flag); ``derived`` (set from another part of an enclosing config, named there; the enclosing
section may not set it itself).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import textwrap
import types
import typing
from typing import Any

from asyncgrpo.errors import ConfigError


def init_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields a config is built from (``init=True``), by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Each field's annotation, evaluated (the configs use ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def is_secret(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("secret"))


def is_derived(f: dataclasses.Field, where: str) -> bool:
    """A ``derived`` field is the enclosing config's to set, so not settable inside a section."""
    return bool(where) and "derived" in f.metadata


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def strip_none(tp: Any) -> Any:
    """``X`` for ``X | None``; any other annotation as it is."""
    if is_union(tp):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return arms[0]
    return tp


def is_list(tp: Any) -> bool:
    return typing.get_origin(strip_none(tp)) in (list, tuple)


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


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


def settable_keys(cls: type, where: str = "") -> list[str]:
    """The keys a mapping for ``cls`` may hold at ``where`` (derived fields left out)."""
    return sorted(n for n, f in init_fields(cls).items() if not is_derived(f, where))


def unknown_key(where: str, key: str, cls: type, *, spell: Any = None) -> ConfigError:
    """The error for a key ``cls`` lacks: the valid keys and the closest one, or, for a key an
    earlier release accepted (the config's ``retired_keys``), what replaced it.

    The one message for a YAML key, an override and an environment variable; ``spell`` writes
    the suggestion as the user would type it (an environment variable's name), default the key.
    """
    if (retired := getattr(cls, "retired_keys", {}).get(key)) is not None:
        return ConfigError(f"{where + key} was removed: {retired}")
    valid = settable_keys(cls, where)
    text = f"unknown key {where + key!r}; valid keys are: {', '.join(valid)}"
    close = difflib.get_close_matches(key, valid, n=1)
    if close:
        text += f"; did you mean {(spell or repr)(close[0])}?"
    return ConfigError(text)


def secret_keys(cls: type, where: str = "") -> list[str]:
    """Dotted keys of every secret field of ``cls`` and its sections (``proxy.api_key``)."""
    hints = type_hints(cls)
    keys = []
    for name, f in init_fields(cls).items():
        if is_secret(f):
            keys.append(where + name)
        elif dataclasses.is_dataclass(hints[name]):
            keys += secret_keys(hints[name], f"{where}{name}.")
    return keys


def leaf_keys(cls: type, where: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every settable non-section field of ``cls`` and its sections, as dotted keys."""
    out = []
    hints = type_hints(cls)
    for name, f in init_fields(cls).items():
        if is_derived(f, where):
            continue
        if dataclasses.is_dataclass(hints[name]):
            out += leaf_keys(hints[name], f"{where}{name}.")
        else:
            out.append((where + name, f))
    return out

"""Text a user typed (a flag, an environment variable, a ``key=value``) to a field's value.

:func:`parse_text` only shapes the text by the field's annotation; the coercion
(:func:`asyncgrpo.config.coerce.coerce`) then checks the result, so YAML and text give the same
errors.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import yaml

from asyncgrpo.config.fields import is_union
from asyncgrpo.errors import ConfigError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~"}


def parse_text(text: str, tp: Any, where: str) -> Any:
    """Parse a command-line or environment string for a field annotated ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if is_union(tp):
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
        raise ConfigError(f"{where}={text!r}: not valid YAML ({one_line(exc)})") from exc
    if origin in (list, tuple) and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return value


def one_line(exc: BaseException | str) -> str:
    """A (YAML parser's) multi-line message as one line."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())

"""Credentials out of text and configs: what a log line, an error, a repr or a metric may show.

Secrets reach text two ways: a config field marked secret (``metadata["secret"]``: shown as
``REDACTED`` by :func:`redacted` and :func:`redacted_repr`), and credentials inside an ordinary
string, mostly URLs (:func:`redact_text`, for every string that leaves a process). The second
is one pure function of the base layer (:mod:`asyncgrpo.errors`, where the command line's error
lines use it too), named here as well: this module is where a caller looks for redaction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncgrpo.config.coerce import to_dict
from asyncgrpo.config.fields import is_derived, is_secret
from asyncgrpo.errors import REDACTED, SAFE_QUERY_KEYS, has_credentials, redact_text, redact_url

__all__ = [
    "REDACTED",
    "SAFE_QUERY_KEYS",
    "has_credentials",
    "redact_text",
    "redact_url",
    "redacted",
    "redacted_repr",
]


def redacted(obj: Any, *, where: str = "") -> Any:
    """``to_dict(obj)`` fit to show: a set secret field is ``REDACTED``, every string has its
    URL credentials hidden. For trackio, logs and dry runs; not loadable back."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return to_dict(_shown(obj))
    out = {}
    for f in dataclasses.fields(obj):
        if is_derived(f, where):
            continue
        value = getattr(obj, f.name)
        hidden = is_secret(f) and value
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
        if is_secret(f) and value:
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

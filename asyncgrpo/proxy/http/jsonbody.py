"""JSON request bodies, decoded in one place with limits: size (413) and nesting depth (400).

Why a depth limit: a body like ``[[[[...]]]]`` ten thousand deep makes the standard library's
decoder (and later the router's canonical re-encoding of chat messages) overflow the stack; it
must be a 400 naming the limit, not a 500 with a traceback. The check is one left-to-right pass
in linear time (a regular expression whose possessive quantifiers never step back): each match
skips everything up to the next bracket outside a string, strings and their escapes included,
so a body of many escaped quotes costs no more than its length.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:  # ~3x faster than json on a token-id prompt; optional (the ``fast`` extra)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads

__all__ = ["MAX_DEPTH", "BodyError", "decode_object", "too_deep"]

#: Deepest nesting of arrays and objects accepted in a request body.
MAX_DEPTH = 128

#: Up to the next bracket outside a string (group 1), or to the end (group 1 empty). A string
#: runs to its closing quote or, unterminated, to the end.
_TO_BRACKET = re.compile(rb'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+"?)*+([\[\]{}]|\Z)', re.DOTALL)


class BodyError(ValueError):
    """The body cannot be used: ``status`` (400 or 413) and a message saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether ``body`` nests arrays and objects deeper than ``limit`` (brackets inside strings
    do not count); stops at the first bracket past the limit."""
    depth = 0
    for m in _TO_BRACKET.finditer(body):
        bracket = m.group(1)
        if bracket == b"[" or bracket == b"{":
            depth += 1
            if depth > limit:
                return True
        elif bracket:
            depth -= 1
    return False


def decode_object(body: bytes, max_bytes: int) -> dict[str, Any]:
    """``body`` as a JSON object; raises :class:`BodyError` (413 over ``max_bytes``, 400 for
    anything that is not a JSON object nested at most :data:`MAX_DEPTH` deep)."""
    if len(body) > max_bytes:
        raise BodyError(413, f"request body too large: {len(body)} bytes > {max_bytes}")
    # Depth is at most the number of brackets: only a body with many is scanned.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and too_deep(body):
        raise BodyError(400, f"request body nests deeper than {MAX_DEPTH} levels")
    try:
        parsed = _fast_loads(body)
    except ValueError:
        try:  # what orjson refuses and json accepts (NaN, ints over 64 bits) is still JSON
            parsed = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise BodyError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise BodyError(400, "request body must be a JSON object")
    return parsed

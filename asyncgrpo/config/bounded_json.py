"""JSON from outside the process, decoded in one place with limits: size and nesting depth.

Everything asyncgrpo decodes from a party it does not control goes through :func:`loads`: the
proxy's request bodies (:mod:`asyncgrpo.proxy.http.jsonbody` turns a refusal into 413 or 400)
and the documents read from storage (:mod:`asyncgrpo.store.documents`: ``policy.json``,
``run.json``, cursors, manifests), where anyone who can write the bucket chose the bytes.

Why a depth limit: a document like ``[[[[...]]]]`` ten thousand deep makes the standard
library's decoder (and later the proxy router's canonical re-encoding of chat messages)
overflow the stack; it must be a refusal naming the limit, not a ``RecursionError``. The check
is one left-to-right pass in linear time (a regular expression whose possessive quantifiers
never step back): each match skips everything up to the next bracket outside a string, strings
and their escapes included, so a document of many escaped quotes costs no more than its length.
Why a size limit: the bytes are held whole and the decoded document takes several times their
size; a reader states the most it needs.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:  # ~3x faster than json on a token-id prompt; optional (the ``fast`` extra)
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - depends on the environment
    _fast_loads = json.loads

__all__ = ["MAX_DEPTH", "JSONRefused", "loads", "loads_object", "too_deep"]

#: Deepest nesting of arrays and objects accepted.
MAX_DEPTH = 128

#: Up to the next bracket outside a string (group 1), or to the end (group 1 empty). A string
#: runs to its closing quote or, unterminated, to the end.
_TO_BRACKET = re.compile(rb'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+"?)*+([\[\]{}]|\Z)', re.DOTALL)


class JSONRefused(ValueError):
    """The document cannot be used; ``too_large`` when its size is the reason."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether ``data`` nests arrays and objects deeper than ``limit`` (brackets inside strings
    do not count); stops at the first bracket past the limit."""
    depth = 0
    for m in _TO_BRACKET.finditer(data):
        bracket = m.group(1)
        if bracket == b"[" or bracket == b"{":
            depth += 1
            if depth > limit:
                return True
        elif bracket:
            depth -= 1
    return False


def loads(data: bytes, max_bytes: int, *, what: str = "the document") -> Any:
    """``data`` decoded; :class:`JSONRefused` (``what`` names it) over ``max_bytes``, nested
    deeper than :data:`MAX_DEPTH`, or not JSON (UTF-8)."""
    if len(data) > max_bytes:
        raise JSONRefused(f"{what} too large: {len(data)} bytes > {max_bytes}", too_large=True)
    # Depth is at most the number of brackets: only a document with many is scanned.
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and too_deep(data):
        raise JSONRefused(f"{what} nests deeper than {MAX_DEPTH} levels")
    try:
        return _fast_loads(data)
    except ValueError:
        try:  # what orjson refuses and json accepts (NaN, ints over 64 bits) is still JSON
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise JSONRefused(f"{what} is not valid JSON: {exc}") from None


def loads_object(data: bytes, max_bytes: int, *, what: str = "the document") -> dict[str, Any]:
    """:func:`loads`, and a JSON object (``{...}``), else :class:`JSONRefused`."""
    parsed = loads(data, max_bytes, what=what)
    if not isinstance(parsed, dict):
        raise JSONRefused(f"{what} must be a JSON object")
    return parsed

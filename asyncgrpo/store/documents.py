"""JSON documents read from storage: bounded, depth-guarded, one error type.

Whoever can write the transport root chose these bytes (``run.json``, ``policy.json``, a
consumer's cursor, a bundle's manifest, and any index a service keeps there). Read whole and
decoded unchecked, a document of gigabytes is a ``MemoryError``, one nested 100,000 deep a
``RecursionError``, one of the wrong shape a ``KeyError`` in the reader: a traceback in
``asyncgrpo export``, a rollout process that stops. :func:`read_document` reads no more than
``max_bytes`` (the transport stops there), decodes with :mod:`asyncgrpo.config.bounded_json`'s depth
guard, and turns every way the bytes can be unusable into one
:class:`~asyncgrpo.errors.IntegrityError` naming the document; :func:`field` reads one typed
field the same way.
"""

from __future__ import annotations

from typing import Any, TypeVar

from asyncgrpo.config.bounded_json import JSONRefused, loads_object
from asyncgrpo.errors import IntegrityError
from asyncgrpo.transport.base import Transport

__all__ = ["MAX_DOCUMENT_BYTES", "field", "parse_document", "read_document"]

T = TypeVar("T")

#: The most a small control document (``run.json``, ``policy.json``: under 200 bytes) may hold.
MAX_DOCUMENT_BYTES = 64 * 1024


def parse_document(raw: bytes, where: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> dict[str, Any]:
    """``raw`` as a JSON object; :class:`IntegrityError` naming ``where`` otherwise."""
    try:
        return loads_object(raw, max_bytes)
    except JSONRefused as exc:
        raise IntegrityError(f"{where} is unusable: {exc}") from None


async def read_document(
    transport: Transport, key: str, *, max_bytes: int = MAX_DOCUMENT_BYTES
) -> dict[str, Any]:
    """The JSON object at ``key``: :class:`~asyncgrpo.errors.NotFound` when missing,
    :class:`IntegrityError` naming it when it holds more than ``max_bytes`` (not read further),
    nests deeper than :data:`~asyncgrpo.config.bounded_json.MAX_DEPTH` or is not a JSON object."""
    raw = await transport.get(key, max_bytes=max_bytes)  # IntegrityError if larger
    return parse_document(raw, f"{transport.url}/{key}", max_bytes)


def field(doc: dict[str, Any], name: str, kind: type[T], where: str) -> T:
    """``doc[name]`` if it is a ``kind`` (an ``int`` is never a ``bool``; a string at most
    1024 characters, an integer at most 18 digits), else :class:`IntegrityError` naming it."""
    value = doc.get(name)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if ok and isinstance(value, str):
        ok = len(value) <= 1024
    if ok and isinstance(value, int):
        ok = abs(value) < 10**18
    if not ok:
        shown = "missing" if name not in doc else f"{type(value).__name__} {str(value)[:40]!r}"
        raise IntegrityError(f"{where}: {name} is not a valid {kind.__name__} ({shown})")
    return value  # type: ignore[return-value]

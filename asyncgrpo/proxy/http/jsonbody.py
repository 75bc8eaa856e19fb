"""JSON request bodies: :mod:`asyncgrpo.config.bounded_json`'s limits as HTTP statuses (size: 413,
nesting depth and the rest: 400)."""

from __future__ import annotations

from typing import Any

from asyncgrpo.config.bounded_json import JSONRefused, loads_object

__all__ = ["BodyError", "decode_object"]


class BodyError(ValueError):
    """The body cannot be used: ``status`` (400 or 413) and a message saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def decode_object(body: bytes, max_bytes: int) -> dict[str, Any]:
    """``body`` as a JSON object; raises :class:`BodyError` (413 over ``max_bytes``, 400 for
    anything that is not a JSON object nested at most ``MAX_DEPTH`` deep)."""
    try:
        return loads_object(body, max_bytes, what="request body")
    except JSONRefused as exc:
        raise BodyError(413 if exc.too_large else 400, str(exc)) from None

"""The inbound API key check, in one place (the front and the aiohttp application both ask it)."""

from __future__ import annotations

import hmac

__all__ = ["AUTH_MESSAGE", "authorized", "expected_header"]

#: What a client without the right key is told (401).
AUTH_MESSAGE = "missing or wrong 'Authorization: Bearer <key>'"


def expected_header(api_key: str | None) -> bytes | None:
    """The ``Authorization`` value a client must send, or None when no key is configured."""
    return f"Bearer {api_key}".encode() if api_key else None


def authorized(expected: bytes | None, got: bytes | None) -> bool:
    """Whether ``got`` (the request's ``Authorization`` value) passes; constant-time compare."""
    return expected is None or hmac.compare_digest(got or b"", expected)

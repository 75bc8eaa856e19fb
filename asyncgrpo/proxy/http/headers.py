"""Which headers cross the proxy, in one place, and an answer's head as bytes."""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

__all__ = [
    "DROP_REQUEST_B",
    "DROP_RESPONSE_B",
    "REPLICA_HEADER",
    "REPLICA_HEADER_B",
    "RUN_HEADER",
    "SESSION_HEADER",
    "head_lines",
]

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing the next hop recomputes.
_HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
               b"trailer", b"transfer-encoding", b"upgrade", b"content-length"}  # fmt: skip
#: Never forwarded to a replica: per-hop headers and the client's own credentials (the replicas
#: get ``upstream_api_key`` instead).
DROP_REQUEST_B = frozenset(_HOP_BY_HOP | {b"host", b"authorization", b"expect"})
#: Never passed back to the client: per-hop headers and what the proxy writes itself.
DROP_RESPONSE_B = frozenset(_HOP_BY_HOP | {b"date", b"server"})

#: Response header naming the replica that served a generation request (debugging, tests).
REPLICA_HEADER = "X-Asyncgrpo-Replica"
REPLICA_HEADER_B = REPLICA_HEADER.encode()
#: Request header naming the session (a multi-turn episode or group) a generation request belongs
#: to, the same value on all its turns: the proxy sends them where the session went before. The
#: name session-affinity routers and verifiers' clients use.
SESSION_HEADER = "X-Session-ID"
#: Request header naming the run a generation request counts for in the proxy's fair share,
#: instead of the run its ``model`` names: an evaluation generates under a training run's
#: adapter names but is a run of its own, with its own share weight.
RUN_HEADER = "X-Asyncgrpo-Run"

_STATUS_LINES: dict[int, bytes] = {}


def head_lines(
    status: int, headers: Iterable[tuple[bytes, bytes]], drop: frozenset[bytes], probe: bytes
) -> tuple[list[bytes], bool]:
    """An answer's status line and its headers not in ``drop`` (lower-case names), as a list the
    caller completes with framing; and whether ``probe`` (a lower-case name) was among them."""
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b"Unknown"
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    out = [line]
    seen = False
    for k, v in headers:
        lower = k.lower()
        if lower not in drop:
            seen = seen or lower == probe
            out += (k, b": ", v, b"\r\n")
    return out, seen

"""Which headers cross the proxy, in one place (str forms for aiohttp, bytes for the raw paths)."""

from __future__ import annotations

__all__ = [
    "DROP_REQUEST",
    "DROP_REQUEST_B",
    "DROP_RESPONSE",
    "DROP_RESPONSE_B",
    "REPLICA_HEADER",
    "REPLICA_HEADER_B",
]

# Hop-by-hop headers (RFC 9110 7.6.1) and the framing the next hop recomputes.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)
#: Never forwarded to a replica: per-hop headers and the client's own credentials (the replicas
#: get ``upstream_api_key`` instead).
DROP_REQUEST = _HOP_BY_HOP | {"host", "authorization", "expect"}
#: Never passed back to the client: per-hop headers and what the proxy writes itself.
DROP_RESPONSE = _HOP_BY_HOP | {"date", "server"}
DROP_REQUEST_B = frozenset(h.encode() for h in DROP_REQUEST)
DROP_RESPONSE_B = frozenset(h.encode() for h in DROP_RESPONSE)

#: Response header naming the replica that served a generation request (debugging, tests).
REPLICA_HEADER = "X-Asyncgrpo-Replica"
REPLICA_HEADER_B = REPLICA_HEADER.encode()

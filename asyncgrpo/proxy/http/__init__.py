"""The proxy's HTTP/1.1 machinery on llhttp (httptools): the server protocol, per-request inbound
state, header rules, JSON body scanning, and the keep-alive client to the replicas.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "H1Pool": "asyncgrpo.proxy.http.h1",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)

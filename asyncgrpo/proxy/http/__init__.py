"""The proxy's HTTP/1.1 wire code on llhttp (httptools): what a request may be (inbound), header
rules, JSON body scanning, and the keep-alive client to the replicas. Nothing here imports the
rest of the proxy: which request goes where is :mod:`asyncgrpo.proxy.front`'s.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "H1Pool": "asyncgrpo.proxy.http.h1",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)

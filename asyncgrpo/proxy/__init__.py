"""One endpoint in front of many vLLM replicas: KV-prefix-affinity routing, health, broadcast.

``python -m asyncgrpo.proxy --upstream URL --upstream URL`` or, in-process,
``async with serve_proxy(ProxyConfig(upstreams=(...), port=0)) as url: ...``.
Runs on the light core (its HTTP on httptools; uvloop and orjson if installed), never torch.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "Decision": "asyncgrpo.proxy.router",
    "ProxyClient": "asyncgrpo.proxy.admin_client",
    "ProxyConfig": "asyncgrpo.config.proxy",
    "Router": "asyncgrpo.proxy.router",
    "request_hashes": "asyncgrpo.proxy.router",
    "serve_proxy": "asyncgrpo.proxy.server",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)

"""The proxy's routing policies, one module each, on the interface of :mod:`.base`; named by
``ROUTING_POLICIES`` in ``asyncgrpo/config/proxy.py`` (the values of ``ProxyConfig.routing``)."""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "Decision": "asyncgrpo.proxy.policies.base",
    "RoutingPolicy": "asyncgrpo.proxy.policies.base",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
